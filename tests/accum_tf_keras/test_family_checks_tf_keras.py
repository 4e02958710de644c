"""tf_keras (new-style; legacy where it applies): the checks of tests/helpers/accum_family_checks.py."""

from tests.helpers.accum_family_checks import *  # noqa: F403 (the checks, collected here)
from tests.helpers.accum_family_checks import (  # noqa: F401 (the fixture family; collected here)
    test_momentum_flush_is_refused_and_the_window_is_carried_exactly,
    tf_keras_family,
)
