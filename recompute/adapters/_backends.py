"""The family split: which Keras a layer belongs to, and the adapter (`_adapter.Adapter`) that handles it.

`_keras3` handles Keras 3 layers (the `keras` package, TensorFlow backend);
`_tf_keras` handles tf_keras layers (Keras 2, which bert4keras runs on).
A Keras 3 layer on the JAX backend is recomputed by `_jax` (`on_jax`).
Detection goes by the layer's class hierarchy, not by `sys.modules["keras"]`,
which bert4keras replaces with tf_keras.
"""

from . import _keras3, _keras_private, _tf_keras


def adapter_for(layer):
    """Returns the module that handles `layer`, or None if it is not a Keras layer."""
    for cls in type(layer).__mro__:
        if cls.__name__ != "Layer":
            continue
        module = cls.__module__
        if module.startswith(_keras_private.MODULE_PREFIX):
            return _keras3
        if module.startswith("tf_keras."):
            return _tf_keras
    return None


ADAPTERS = (_keras3, _tf_keras)


def on_jax(adapter):
    """True if `adapter`'s layers run on Keras 3's JAX backend (recomputed by `recompute.engine._jax`)."""
    return adapter is _keras3 and _keras3.backend() == "jax"


def check_decoration(fn):
    """Refuses, at decoration, what no family's setup can serve (a Keras 3 backend other than TensorFlow and JAX)."""
    for adapter in ADAPTERS:
        adapter.check_decoration(fn)
