"""Two logical CPU devices for the `MirroredStrategy` tests (set before TensorFlow initializes them)."""

import tensorflow as tf

try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # already initialized (another suite ran first in this process)
    pass
