"""Fixtures for the tf_keras accum tests; two logical CPU devices for the `MirroredStrategy`
tests (set before TensorFlow initializes them)."""

import pytest
import tensorflow as tf
import tf_keras as K

try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # already initialized (another suite ran first in this process)
    pass


@pytest.fixture
def floatx():
    """Sets tf_keras floatx for one test."""
    previous = K.backend.floatx()

    def set_to(dtype):
        K.backend.set_floatx(dtype)
        return dtype

    yield set_to
    K.backend.set_floatx(previous)
