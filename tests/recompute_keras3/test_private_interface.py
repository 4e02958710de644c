"""Keras 3 (TensorFlow backend): every private Keras or TensorFlow name that `recompute`
relies on -- listed in the `PRIVATE_NAMES` of `recompute.adapters._keras_private`,
`recompute.adapters._mha_private` (Keras 3's `MultiHeadAttention`) and `recompute.adapters._tf` -- exists
on the installed versions (tests/helpers/private_names_checks.py)."""

import keras
import numpy as np
import tensorflow as tf

from recompute.adapters import _keras_private, _mha_private, _tf
from tests.helpers.private_names_checks import assert_listed_names_exist


def built_mha(mha_class):
    layer = mha_class(num_heads=2, key_dim=4, dropout=0.1)
    x = np.ones((1, 3, 4), "float32")
    layer(x, x)
    return layer


def keras3_made():
    return {
        _keras_private.LAYER: keras.layers.Layer,
        _keras_private.VARIABLE: lambda: keras.Variable(np.ones(2, "float32")),
        _keras_private.MASKED: lambda: keras.layers.Masking()(np.ones((1, 2, 1), "float32")),
        _mha_private.KERAS3: lambda: built_mha(keras.layers.MultiHeadAttention),
    }


def test_keras_private_names_exist():
    assert_listed_names_exist(_keras_private, keras3_made())


def test_mha_private_names_exist():
    assert_listed_names_exist(_mha_private, keras3_made(), owners=lambda path: path.startswith("keras."))


def test_tf_private_names_exist():
    made = {
        "tensorflow.python.framework.func_graph.FuncGraph": lambda: _traced_graph(),
        _tf._DISTRIBUTED_VARIABLE: lambda: _mirrored_variable(),
    }
    assert_listed_names_exist(_tf, made)


def test_the_names_that_are_not_attributes():
    # the modules Keras 3's layers come from, and the key of the current call's context
    assert keras.layers.Layer.__module__.startswith(_keras_private.MODULE_PREFIX)
    assert keras.layers.Dense.__module__.startswith(_keras_private.MODULE_PREFIX)
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(_keras_private.global_attribute(_keras_private.CURRENT_CALL_CONTEXT))
            return x

    Probe()(np.ones((1, 2), "float32"))
    assert seen and seen[0] is not None
    pending = _keras_private.global_attribute(
        _keras_private.UNINITIALIZED_VARIABLES, [], set_to_default=True)
    assert isinstance(pending, list)
    module, name = _keras_private.GELU
    assert (keras.activations.gelu.__module__, keras.activations.gelu.__name__) == (module, name)


def _traced_graph():
    graphs = []

    @tf.function
    def f():
        graphs.append(tf.compat.v1.get_default_graph())
        return tf.constant(1.0)

    f()
    return graphs[0]


def _mirrored_variable():
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        return tf.Variable(1.0)
