"""recompute_grad on Keras 3: rough edges (non-tensor outputs, misuse caught early, reload):
the tests of tests/helpers/recompute_edge_checks.py."""

from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.recompute_edge_checks import *  # noqa: F403 (the tests, collected here)
