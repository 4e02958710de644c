"""`recomputed_cores`: keras-hub's own attention cores recomputed, for `patch(policy="attention")`.

keras-hub's language-model decoders (Gemma, Llama, Mistral, Qwen, Phi-3, ...)
and DeBERTa-v3 compute attention in a method of their attention layer
(`_compute_attention`; XLNet's `compute_attention`), not in Keras's
`MultiHeadAttention` core. While `recomputed_cores` is active, that method of
each such layer in a block keeps only its inputs and runs again in the
backward pass: on TensorFlow through `recompute.engine._core` (when a tape records),
on JAX as a `jax.checkpoint` (`recompute.engine._jax`), its dropout replayed from the
same seed state either way -- the loss and gradients of RECOMPUTE=0. The
method is shadowed on the layer instance and restored on exit; the class and
other instances are untouched. A core runs as written inside a call that is
recomputed already, and where nothing is differentiated.
"""

import contextlib

from .. import engine as engines
from ..adapters import _backends, _keras_private
from .._scoped import shadowed


def _recomputed(method, layer, args, kwargs):
    """`method(layer, *args, **kwargs)`, recomputed for the gradient where one is taken."""
    engine = engines.of(_backends.adapter_for(layer))
    if not engine.recomputes():
        return method(layer, *args, **kwargs)
    return engine.recomputed_call(method, layer, args, kwargs)


def core_layers(block, pairs):
    """(layer, method name) for each sublayer of `block` that is an instance of one of the
    attention classes of `pairs` ((class, method name), ...)."""
    found = []
    for layer in _keras_private.flatten_layers(block, include_self=False):
        for cls, name in pairs:
            if isinstance(layer, cls):
                found.append((layer, name))
                break
    return found


@contextlib.contextmanager
def recomputed_cores(layers):
    """While active, the core method of each `(layer, method name)` is recomputed.

    A core shadowed already (an enclosing block's) is left as it is.
    """
    def core_of(layer, method):
        def core(*args, **kwargs):
            return _recomputed(method, layer, args, kwargs)

        return core

    with shadowed((layer, name, core_of(layer, getattr(type(layer), name)))
                  for layer, name in layers if name not in vars(layer)):
        yield
