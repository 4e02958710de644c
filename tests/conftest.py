import os
import sys

import pytest

# Quieter TensorFlow logs; tests never need a GPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def mirrored_strategy():
    """The one `MirroredStrategy` on the 2 logical CPUs (configured by the suites'
    conftest.py) that every test module of this process uses.

    Each strategy numbers its collective ops from the same keys, so two of them
    in one process would run collectives whose keys clash ("Shape mismatch in
    the collective instance"), e.g. tests/keras3 followed by tests/accum_keras3.
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
