"""recompute.keras_hub.patch() over every keras-hub block class it covers, on Keras's JAX
backend: exact under both policies, recomputing, decoding calls left alone, unpatch.
(The tests: tests.helpers.keras_hub_decoder_checks.)"""

import pytest

pytest.importorskip("keras_hub")

# The first of these tests compiles the tiny ops' kernels that every other one reuses
# (a minute on a slow CPU): the newest Python's full run only.
pytestmark = pytest.mark.slow(seconds=25)

from tests.helpers.keras_hub_decoder_checks import *  # noqa: E402,F403 (the tests, collected here)
