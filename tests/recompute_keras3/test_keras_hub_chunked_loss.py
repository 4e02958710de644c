"""`recompute.keras_hub.chunked_loss` on Keras's TensorFlow backend: loss, gradients, fit with
LoRA and AccumOptimizer, evaluate and accuracy equal the full-logit model's; predict
unchanged; compile again drops it; refusals. (The tests: tests.helpers.keras_hub_chunked_checks.)"""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers.keras_hub_chunked_checks import *  # noqa: E402,F403 (the tests, collected here)
