"""The policies' functions on Keras 3's JAX backend, run by the JAX engine
(`recompute.engine._jax`: the call as a `jax.checkpoint`, the layer's state threaded
through): `full` (the whole call one checkpoint) and `attention` (the attention cores
and the GELUs checkpointed inside a call that keeps the rest); `_policies.POLICIES`
names both engines' functions.
"""

import contextlib

from ..adapters import _keras3
from ..engine import _jax as _engine, _running
from .._scoped import shadowed


def full(fn, layer, args, kwargs):
    """The whole call is one `jax.checkpoint`: it keeps its inputs, runs again in the backward
    pass; its attention cores run blocked (`_flash`), in both passes."""
    from ..ops._attention import with_blocked_cores

    layers = _keras3.attention_layers(_keras3.sublayers(layer))
    if layers:
        fn = with_blocked_cores(fn, lambda: _cores_blocked(layers, _keras3.attention_core))
    return _engine.recomputed_call(fn, layer, args, kwargs)


def attention(fn, layer, args, kwargs):
    """Only the attention core (`MultiHeadAttention._compute_attention`) of each multi-head
    attention layer in the call keeps less: blocked (`_flash_jax`: it keeps its inputs and
    the dropout's bits), or, where the core is not the standard case, a `jax.checkpoint`
    (its dropout replayed from the seed state); and the exact GELUs of its `Dense`
    sublayers keep only their input (`_gelu.checkpointed`); everything else is kept."""
    from ..ops import _gelu
    from ..ops._attention import attention_layers  # the check and its message, shared

    layers = attention_layers(_keras3, layer)
    with _cores_blocked(layers, _keras3.attention_core, checkpoint_others=True), \
            _gelu.kept_input(_keras3.sublayers(layer), _gelu.checkpointed):
        return fn(layer, *args, **kwargs)


@contextlib.contextmanager
def _cores_blocked(layers, name, checkpoint_others=False):
    """While active, `name` (the attention core) of each layer runs as the blocked core
    where it is the standard case (`_attention.keras_blocked`), else -- with
    `checkpoint_others` -- under `recomputed_call`, else as written. An instance
    attribute shadows the method (`recompute._scoped.shadowed`), removed on exit."""
    from ..ops import _attention, _flash_jax

    def core_of(lyr, method):
        def core(*args, **kwargs):
            if _engine.in_shape_inference():
                return method(lyr, *args, **kwargs)
            blocked = _attention.keras_blocked(
                _flash_jax, method, lyr, args, kwargs, _keras3.scores_asked(args, kwargs))
            if blocked is not None:
                return blocked
            if not checkpoint_others or _running.inside_recomputed_call():
                return method(lyr, *args, **kwargs)
            return _engine.recomputed_call(method, lyr, args, kwargs)

        return core

    # a core shadowed already (an enclosing decorated call's) is left as it is
    with shadowed((lyr, name, core_of(lyr, getattr(type(lyr), name)))
                  for lyr in layers if name not in vars(lyr)):
        yield
