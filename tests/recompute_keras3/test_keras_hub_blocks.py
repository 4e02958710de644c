"""recompute.keras_hub.patch() over every keras-hub block class it covers, on Keras's TensorFlow
backend: exact under both policies, recomputing, decoding calls left alone, unpatch.
(The tests: tests.helpers.keras_hub_decoder_checks.)"""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers.keras_hub_decoder_checks import *  # noqa: E402,F403 (the tests, collected here)
