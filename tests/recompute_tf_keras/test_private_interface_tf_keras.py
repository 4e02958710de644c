"""tf_keras: every private tf_keras name that `recompute` relies on -- listed in the
`PRIVATE_NAMES` of `recompute.adapters._tf_keras` and `recompute.adapters._mha_private` (tf_keras's
`MultiHeadAttention`) -- exists on the installed tf_keras
(tests/helpers/private_names_checks.py)."""

import numpy as np
import tensorflow as tf
import tf_keras

from recompute.adapters import _mha_private, _tf_keras
from tests.helpers.private_names_checks import assert_listed_names_exist


def _random_generator():
    from tf_keras.src import backend

    generator = backend.RandomGenerator(seed=1, rng_type="stateful")
    generator._maybe_init()
    return generator


def _autocast_variable():
    from tf_keras.src.mixed_precision import autocast_variable

    return autocast_variable.create_autocast_variable(tf.Variable(np.ones(2, "float32")))


def _call_context():
    from tf_keras.src.engine import base_layer_utils

    return base_layer_utils.call_context()


def _built_mha():
    layer = tf_keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.1)
    x = np.ones((1, 3, 4), "float32")
    layer(x, x)
    return layer


MADE = {
    "tf_keras.layers.Layer": tf_keras.layers.Layer,
    "tf_keras.layers.Dropout": lambda: tf_keras.layers.Dropout(0.5),
    "a tensor a tf_keras.layers.Masking call returns":
        lambda: tf_keras.layers.Masking()(tf.ones((1, 2, 1))),
    "tf_keras.src.engine.base_layer_utils.CallContext": _call_context,
    "tf_keras.src.mixed_precision.autocast_variable.AutoCastVariable": _autocast_variable,
    "tf_keras.src.backend.RandomGenerator": _random_generator,
    _mha_private.TF_KERAS: _built_mha,
}


def test_tf_keras_private_names_exist():
    assert_listed_names_exist(_tf_keras, MADE)


def test_mha_private_names_exist():
    assert_listed_names_exist(_mha_private, MADE, owners=lambda path: path.startswith("tf_keras."))


def test_the_names_that_are_not_attributes():
    module, name = _tf_keras.GELU
    gelu = tf_keras.activations.gelu
    assert (gelu.__module__, gelu.__name__) == (module, name)
    assert _mha_private.CORE == _tf_keras.attention_core
