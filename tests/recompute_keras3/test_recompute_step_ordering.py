"""Keras 3 (TensorFlow backend): the recomputation's weight reads run before the optimizer's
writes of those weights (the tests of tests/helpers/step_ordering.py, which says what raced and why)."""

from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.step_ordering import *  # noqa: F403 (the tests, collected here)
