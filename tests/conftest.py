import os

import pytest

# Quieter TensorFlow logs; tests never need a GPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _two_logical_cpus():
    """Two logical CPU devices, for the `MirroredStrategy` tests of every suite.

    Set here, before any test module initializes TensorFlow's devices, so that
    each suite runs on its own (`pytest tests/recompute_keras3` alone runs its
    distribution tests too).
    """
    import tensorflow as tf

    try:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # already initialized by the importer: the distribution tests say so
        pass


_two_logical_cpus()


@pytest.fixture(scope="session")
def mirrored_strategy():
    """The one `MirroredStrategy` on the 2 logical CPUs (configured by the suites'
    conftest.py) that every test module of this process uses.

    Each strategy numbers its collective ops from the same keys, so two of them
    in one process would run collectives whose keys clash ("Shape mismatch in
    the collective instance"), e.g. tests/recompute_keras3 followed by tests/accum_keras3.
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
