"""LoRA + recompute.keras_hub.patch() + AccumOptimizer on a keras-hub causal LM, on Keras's
TensorFlow backend: LoRA gradients equal the unpatched model's, accumulation exact over the
LoRA weights with the frozen weights fixed, save and resume in a fresh process.
(The tests: tests.helpers.keras_hub_lora_checks.)"""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers.keras_hub_lora_checks import *  # noqa: E402,F403 (the tests, collected here)
