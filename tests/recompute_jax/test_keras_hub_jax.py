"""recompute.keras_hub on Keras's JAX backend: patched TransformerEncoder layers
recompute exactly (dropout, padding), built before or after patch(), by from_preset too;
the real MiniLM loads offline as a keras-hub preset and matches the NumPy BERT.
(The tests: tests.helpers.keras_hub_checks.)"""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers.keras_hub_checks import *  # noqa: E402,F403 (the tests, collected here)
