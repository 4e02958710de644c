"""The family split: which Keras a layer belongs to, and the adapter (`_adapter.Adapter`) that handles it.

`_keras3` handles Keras 3 layers (the `keras` package, TensorFlow backend);
`_tf_keras` handles tf_keras layers (Keras 2, which bert4keras runs on).
Detection goes by the layer's class hierarchy, not by `sys.modules["keras"]`,
which bert4keras replaces with tf_keras.
"""

from . import _keras3, _tf_keras


def adapter_for(layer):
    """Returns the module that handles `layer`, or None if it is not a Keras layer."""
    for cls in type(layer).__mro__:
        if cls.__name__ != "Layer":
            continue
        module = cls.__module__
        if module.startswith("keras.src."):
            return _keras3
        if module.startswith("tf_keras."):
            return _tf_keras
    return None


ADAPTERS = (_keras3, _tf_keras)


def check_decoration(fn):
    """Refuses, at decoration, what no family's setup can serve (a Keras 3 backend other than TensorFlow)."""
    for adapter in ADAPTERS:
        adapter.check_decoration(fn)
