"""`patch()` / `unpatch()`: keras-hub's `TransformerEncoder` recomputes with `recompute_grad`."""

from .. import _policies
from .._decorator import recompute_grad

POLICIES = _policies.NAMES  # "full", "attention"
_patched = {}  # class -> (its own `call` before `patch()`, the policy)


def _encoder_class():
    try:
        import keras_hub
    except ImportError as e:
        raise ImportError(
            "`recompute.keras_hub.patch()` patches keras-hub, which is not installed: "
            'pip install "keras-train-memory[hub]" (or keras-hub==0.32.*).'
        ) from e
    return keras_hub.layers.TransformerEncoder


def patch(policy="full"):
    """Makes every keras-hub `TransformerEncoder` recompute whenever `RECOMPUTE` is on.

    ```python
    import recompute.keras_hub
    recompute.keras_hub.patch()                  # or patch(policy="attention")
    backbone = keras_hub.models.BertBackbone.from_preset(path)
    ```

    The class's `call` is replaced by `recompute_grad(call, policy=policy)`:
    models built before or after `patch()` (by `from_preset` too) recompute
    each encoder block as a unit (`"full"`: only the block's input is kept)
    or only its attention core (`"attention"`), exactly -- the loss and
    gradients of RECOMPUTE=0, dropout and padding masks included -- on
    Keras's TensorFlow and JAX backends. Idempotent; calling it with another
    policy switches policy; `unpatch()` restores keras-hub's own `call`.
    Imports keras-hub (install the `[hub]` extra).

    Args:
        policy: "full" (default) or "attention" (`recompute.POLICIES`).
    """
    _policies.check_policy(policy)
    cls = _encoder_class()
    if cls in _patched:
        if _patched[cls][1] == policy:
            return
        original = _patched[cls][0]
    else:
        original = cls.__dict__["call"]
    cls.call = recompute_grad(original, policy=policy)
    _patched[cls] = (original, policy)


def unpatch():
    """Restores keras-hub's own `TransformerEncoder.call` (nothing to do if not patched)."""
    for cls, (original, _) in list(_patched.items()):
        cls.call = original
        del _patched[cls]


def is_patched():
    """The policy `patch()` installed ("full" or "attention"), or None."""
    for _, policy in _patched.values():
        return policy
    return None
