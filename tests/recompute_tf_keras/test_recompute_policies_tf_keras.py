"""recompute_grad(policy=...) on a standard tf_keras transformer block (the Keras 3
suite's tests, tests.helpers.attention_blocks, on tf_keras's MultiHeadAttention)."""

import pytest
import tf_keras as keras

from tests.helpers.attention_blocks import *  # noqa: F403 (the shared tests, collected here)
from tests.helpers.families import tf_keras  # noqa: F401 (the fixture K)


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG: RECOMPUTE=1 then draws the masks RECOMPUTE=0 draws."""
    keras.backend.experimental.enable_tf_random_generator()
    yield
