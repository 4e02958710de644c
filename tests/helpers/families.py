"""The fixture `K` (the Keras family module of this pytest process) for the recompute
checks written once for both families (`recompute_*_checks` modules).

Each family runs in a pytest process of its own (README): a suite's thin test
module imports the checks and the one fixture of its family, `keras3` or
`tf_keras`, both named `K`.
"""

import pytest


@pytest.fixture(name="K")
def keras3():
    """Keras 3 (TensorFlow backend)."""
    import keras

    return keras


@pytest.fixture(name="K")
def tf_keras():
    """tf_keras (Keras 2)."""
    import tf_keras as keras

    return keras


def is_tf_keras(K):
    return K.__name__ == "tf_keras"


def variable_name(K, v):
    """A variable's name with its layer's ("dense/kernel"): Keras 3's `path`, tf_keras's `name`."""
    return v.name if is_tf_keras(K) else v.path


def ops_sum(K):
    """A sum that takes symbolic tensors of the family: `keras.ops.sum` or `tf.reduce_sum`."""
    import tensorflow as tf

    return tf.reduce_sum if is_tf_keras(K) else K.ops.sum


def ops_concatenate(K):
    import tensorflow as tf

    return tf.concat if is_tf_keras(K) else K.ops.concatenate
