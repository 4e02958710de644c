"""Keras 3: `accum.keras3._inner` implements `accum._inner.InnerApi`, and the private names
it relies on exist on the installed Keras (tests/helpers/accum_inner_checks.py)."""

from tests.helpers.accum_inner_checks import *  # noqa: F403 (the checks, collected here)
from tests.helpers.accum_inner_checks import keras3_apis  # noqa: F401 (the fixture api)
