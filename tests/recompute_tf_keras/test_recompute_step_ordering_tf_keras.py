"""tf_keras: the recomputation's weight reads run before the optimizer's writes of those
weights (the tests of tests/helpers/step_ordering.py, which says what raced and why)."""

import pytest
import tf_keras as keras

from tests.helpers.families import tf_keras  # noqa: F401 (the fixture K)
from tests.helpers.step_ordering import *  # noqa: F403 (the tests, collected here)


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable dropout (tf.random.Generator), as a user seeking RECOMPUTE=0's numbers runs."""
    keras.backend.experimental.enable_tf_random_generator()
    yield
