"""`patch()` / `unpatch()` / `covered(model)`: the blocks of `_blocks.BLOCKS` recompute with `recompute_grad`.

A change of the patch (`patch()`, a policy switch, `unpatch()`) reaches the steps Keras
compiled before it: a `fit`, `evaluate`, `predict` or `train_on_batch` traces its step once
and reuses it, without running any block's `call` again, so a model fitted before `patch()`
would go on training unpatched. `_retrace` replaces the traced steps (`train_function`,
`test_function`, `predict_function`, which `compile()` resets) of every live Keras model
with a block of a changed class by a `_Retraced`, which has Keras trace the step anew when
it is next run (between steps: a `fit` running then goes on with the new step). The models
are found by walking Python's heap (`gc.get_objects`): `patch()` cannot see models
otherwise, and nothing of a model traced before the first `patch()` runs code of this
package.
"""

import gc
import inspect
import warnings
import weakref

from .. import _config
from ..adapters import _keras3
from ..policies import _registry
from .._decorator import _check_offload, recompute_grad
from . import _blocks, _cores

POLICIES = _registry.NAMES  # "full", "attention"
_patched = {}  # class -> (its own `call` before `patch()`, the policy, offload)
_MARK = "__recompute_keras_hub__"  # on a patched `call`: its policy
_warned = set()  # the block classes policy="attention" recomputed in full, warned about once


def _import_keras_hub():
    try:
        import keras_hub  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "`recompute.keras_hub.patch()` patches keras-hub, which is not installed: "
            'pip install "keras-train-memory[hub]" (or keras-hub==0.32.*).'
        ) from e


def _decoding(signature, cache_args, args, kwargs):
    """True if the call passes one of `cache_args` (not None): keras-hub decoding with a cache."""
    if not cache_args:
        return False
    try:
        bound = signature.bind(None, *args, **kwargs).arguments  # `self` is not needed
    except TypeError:
        return True  # a call keras-hub's own `call` will refuse: let it say why
    extra = next((bound[p.name] for p in signature.parameters.values()
                  if p.kind == p.VAR_KEYWORD and p.name in bound), {})
    return any(bound.get(name, extra.get(name)) is not None for name in cache_args)


def _warn_full(cls):
    if cls in _warned:
        return
    _warned.add(cls)
    warnings.warn(
        f"recompute.keras_hub.patch(policy='attention'): `{cls.__name__}` computes its "
        "attention inside its layers' `call` (no attention core to recompute), so its "
        "blocks are recomputed in full (policy='full') instead. docs/keras_hub.md lists "
        "the blocks whose core policy='attention' reaches.",
        stacklevel=4,
    )


def _patched_call(cls, row, original, policy, offload=False):
    """`cls.call` when patched: decoding as keras-hub wrote it, training recomputed (with
    `offload`, policy "full": its inputs kept in host memory on JAX)."""
    signature = inspect.signature(original)
    keras_attention = policy == "attention" and row.core == _blocks.KERAS
    recomputed = recompute_grad(original, policy="attention" if keras_attention else "full",
                                offload=offload)
    own_cores = _blocks.cores(row) if policy == "attention" and not keras_attention else ()

    def call(self, *args, **kwargs):
        if _decoding(signature, row.cache, args, kwargs):
            return original(self, *args, **kwargs)
        if policy == "attention" and not keras_attention:
            layers = _cores.core_layers(self, own_cores)
            if not layers:
                _warn_full(type(self))
            elif not _config.is_enabled():
                return original(self, *args, **kwargs)
            else:
                with _cores.recomputed_cores(layers):
                    return original(self, *args, **kwargs)
        return recomputed(self, *args, **kwargs)

    call.__name__, call.__qualname__ = "call", f"{cls.__qualname__}.call"
    call.__module__, call.__doc__ = original.__module__, original.__doc__
    call.__signature__ = signature  # Keras reads `training` and `mask` from it
    call.__recompute_grad_wrapped__ = original
    setattr(call, _MARK, policy)
    return call


def patch(policy="full", offload=False):
    """Makes every Transformer block of keras-hub recompute its training calls whenever `RECOMPUTE` is on.

    ```python
    import recompute.keras_hub
    recompute.keras_hub.patch()                  # or patch(policy="attention")
    causal_lm = keras_hub.models.GemmaCausalLM.from_preset(path)
    ```

    Each block class of `_blocks.BLOCKS` (docs/keras_hub.md lists them:
    `TransformerEncoder`/`TransformerDecoder` and the models built on them,
    the Gemma, Llama, Mistral, Mixtral, Qwen, Phi-3, GPT-NeoX, GPT-OSS,
    SmolLM3, Bloom, Falcon, T5, DeBERTa-v3, ... blocks) gets a `call` that
    runs a decoding call (one given a generation cache: `generate`,
    `call_with_cache`) as keras-hub wrote it, and a training call through
    `recompute_grad` -- exactly: the loss and gradients of RECOMPUTE=0,
    dropout (random state replayed) and masks included, on Keras's
    TensorFlow and JAX backends. Models built before or after `patch()` (by
    `from_preset` too) are covered; `covered(model)` says which of a model's
    blocks are, and warns when none is.

    Models compiled and trained before too: Keras traces a model's
    `fit`/`train_on_batch`, `evaluate` and `predict` steps once and reuses them,
    so `patch()` (a policy switch, `unpatch()` likewise) marks the traced steps
    of every live Keras model that has a block of a changed class stale: its
    next step is traced anew, with the `call` of now (a `fit` running when a
    callback calls `patch()` goes on with a new step). A `tf.function` or
    `jax.jit` of your own traced before keeps what it traced: trace it again.
    `RECOMPUTE` is read when a step is traced (`compile()` again to switch it
    for a model trained already).

    `policy="full"` recomputes each block as a unit (only its inputs are
    kept). `policy="attention"` recomputes only each block's attention core:
    Keras's `MultiHeadAttention` core as `recompute_grad(policy="attention")`
    does, or the attention layer's own core method (Gemma's, Llama's, ...).
    Blocks that compute attention inline (Bloom, Falcon, T5, ESM,
    RoFormerV2, and Qwen3.5's linear-attention layers) have no core to
    reach: they are recomputed in full, with one warning per class at its
    first call.

    Idempotent; calling it with another policy switches policy; `unpatch()`
    restores every class. A class missing from the installed keras-hub is
    skipped. Imports keras-hub (install the `[hub]` extra).

    `offload=True` (JAX, `policy="full"`): each block keeps its inputs in pinned
    host memory, not the accelerator's, from the forward to the backward pass,
    exactly (`recompute_grad(offload=True)`; docs/recompute.md, "Host offload"). Check
    the plan first (`python -m benchmarks.gpu_plan --offload`): at BERT-base XLA:GPU
    plans 6.8 MiB per sample of device memory with it against 25.4 without at batches 8
    and 32 (blocks in cuts of 8 samples, `recompute.batch_cut`), but more with it than
    without at batches 2 and 4.

    Args:
        policy: "full" (default) or "attention" (`recompute.POLICIES`).
        offload: True keeps each block's inputs in host memory on JAX (policy
            "full" only; a ValueError with "attention"; on TensorFlow, a
            ValueError at a block's recomputed call).
    """
    _registry.check_policy(policy)
    offload = _check_offload(offload, policy)
    _import_keras_hub()
    changed = []
    for cls, row in _blocks.installed():
        if cls in _patched:
            if _patched[cls][1:] == (policy, offload):
                continue
            original = _patched[cls][0]
        else:
            original = cls.__dict__["call"]
        cls.call = _patched_call(cls, row, original, policy, offload)
        _patched[cls] = (original, policy, offload)
        changed.append(cls)
    _retrace(changed)


def unpatch():
    """Restores keras-hub's own `call` of every patched block class (nothing to do if not patched).

    Like `patch()`, makes the models compiled while patched trace their steps anew at their
    next `fit`, `evaluate`, `predict` or `train_on_batch`.
    """
    changed = []
    for cls, (original, *_) in list(_patched.items()):
        cls.call = original
        del _patched[cls]
        changed.append(cls)
    _retrace(changed)


# The steps Keras traces once and reuses (`compile()` resets them): `fit`/`train_on_batch`,
# `evaluate`/`test_on_batch`, `predict`/`predict_on_batch`; a `tf.function`, on JAX a `jax.jit`
# of the step, made anew with the step by `make_<name>()`.
_STEPS = ("train_function", "test_function", "predict_function")


class _Retraced:
    """Stands in for a traced step of `model` that a change of the patch made stale: the
    first call has Keras make the step anew (`make_<name>()`, which traces it) and runs it.

    Not None, as `compile()` leaves it: a `fit` running when `patch()` is called (from one of
    its callbacks) reads its step again at every step, and goes on with the new one.
    """

    def __init__(self, model, name):
        self._model = weakref.ref(model)
        self._name = name

    def __deepcopy__(self, memo):
        return None  # a deep copy of the model traces its own steps (this one's are the original's)

    def __call__(self, *args, **kwargs):
        model = self._model()
        setattr(model, self._name, None)
        getattr(model, "make_" + self._name)()
        step = getattr(model, self._name)
        if step is None or isinstance(step, _Retraced):
            raise RuntimeError(
                f"recompute.keras_hub: model '{model.name}' made no `{self._name}` anew after "
                f"the patch changed: its `make_{self._name}()` did not set it."
            )
        return step(*args, **kwargs)


def _retrace(classes):
    """Makes every live Keras model that has a layer of one of `classes` (block classes whose
    `call` just changed) trace its steps anew when it next runs them. Returns those models."""
    if not classes:
        return []
    import keras

    classes = tuple(classes)
    retraced = []
    for obj in gc.get_objects():
        # `type`, not `isinstance`: no `__class__` of an arbitrary object (a lazy module) is read
        if not issubclass(type(obj), keras.Model):
            continue
        steps = [name for name in _STEPS
                 if getattr(obj, name, None) is not None and not isinstance(getattr(obj, name), _Retraced)]
        if steps and any(isinstance(layer, classes) for layer in _keras3.sublayers(obj)):
            for name in steps:
                setattr(obj, name, _Retraced(obj, name))
            retraced.append(obj)
    return retraced


def is_patched():
    """The policy `patch()` installed ("full" or "attention"), or None."""
    for _, policy, _offload in _patched.values():
        return policy
    return None


def covered(model):
    """The layers of `model` (a keras-hub backbone, task or any Keras model) that `patch()`
    recomputes: the blocks whose class's `call` is patched now.

    ```python
    recompute.keras_hub.patch()
    blocks = recompute.keras_hub.covered(causal_lm)   # e.g. its GemmaDecoderBlock layers
    ```

    Warns (`UserWarning`) when there are none -- keras-hub not patched, or a model
    built from blocks the registry does not list (docs/keras_hub.md): such a model
    trains as without `patch()`, keeping every activation. The blocks listed
    recompute at the model's next step, compiled before `patch()` or not
    (`patch()` makes the model trace its steps anew).

    Args:
        model: a Keras model or layer (a block itself lists itself).

    Raises:
        TypeError: `model` is not a Keras layer (None, a string, a class).
    """
    import keras

    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "`model` must be a Keras model or layer (a keras-hub backbone or task, any "
            f"`keras.Model`). Received: model={model!r} of type {type(model).__name__}"
        )
    layers = [layer for layer in _keras3.sublayers(model)
              if getattr(type(layer).call, _MARK, None) is not None]
    if not layers:
        reason = ("keras-hub is not patched: call `recompute.keras_hub.patch()`"
                  if not _patched else
                  "none of its layers is a Transformer block `patch()` covers "
                  "(docs/keras_hub.md lists them)")
        warnings.warn(
            f"recompute.keras_hub: model '{model.name}' has no block that recomputes: "
            f"{reason}. It trains as without recomputation.",
            stacklevel=2,
        )
    return layers
