"""recompute_grad on tf_keras: rough edges (non-tensor outputs, misuse caught early, RNG advice):
the tests of tests/helpers/recompute_edge_checks.py.

Runs in the tf_keras pytest process (see README).
"""

import pytest
import tf_keras as keras

from tests.helpers.families import tf_keras  # noqa: F401 (the fixture K)
from tests.helpers.recompute_edge_checks import *  # noqa: F403 (the tests, collected here)


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG (tf.random.Generator): dropout masks equal those of RECOMPUTE=0."""
    keras.backend.experimental.enable_tf_random_generator()
    yield
    keras.backend.experimental.enable_tf_random_generator()
