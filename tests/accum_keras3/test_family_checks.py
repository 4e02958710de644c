"""Keras 3 (TensorFlow backend): the checks of tests/helpers/accum_family_checks.py."""

from tests.helpers.accum_family_checks import *  # noqa: F403 (the checks, collected here)
from tests.helpers.accum_family_checks import (  # noqa: F401 (the fixture family; collected here)
    keras3_family,
    test_momentum_flush_is_refused_and_the_window_is_carried_exactly,
)
