"""recompute_grad on Keras 3: calls that open their own GradientTape (D4) and RNN cells (D6):
the tests of tests/helpers/recompute_inner_tape_checks.py."""

from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.recompute_inner_tape_checks import *  # noqa: F403 (the tests, collected here)
