"""recompute.keras_hub on Keras's TensorFlow backend: patched TransformerEncoder layers
recompute exactly (dropout, padding), built before or after patch(), by from_preset too;
the real MiniLM loads offline as a keras-hub preset and matches the NumPy BERT.
(The checks: tests.helpers.keras_hub_checks.)"""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers import keras_hub_checks as checks  # noqa: E402


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_patch_is_exact_and_reversible(policy):
    checks.check_patch(policy)


@pytest.fixture(scope="module")
def reference():
    return checks.numpy_reference()


def test_minilm_preset_matches_numpy_bert_and_recomputes_exactly(tmp_path, reference):
    checks.check_minilm_preset(tmp_path, reference)
