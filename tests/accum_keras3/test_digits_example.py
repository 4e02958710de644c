"""examples/accum_digits.py on a small setting: Accum(Adam, k) at batch 1 matches Adam at batch k."""

import importlib.util
import os

import pytest

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (test extra)")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "accum_digits.py")


def test_accum_at_batch_1_matches_batch_k(capsys):
    spec = importlib.util.spec_from_file_location("accum_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results, max_diff = example.main(["--k", "4", "--epochs", "2", "--limit", "150"])
    out = capsys.readouterr().out
    assert "Accum(Adam,4) b=1" in out and "max |weights" in out
    assert max_diff <= 1e-5
    for (loss_a, acc_a), (loss_k, acc_k) in zip(results["accum"], results["batchk"]):
        assert loss_a == pytest.approx(loss_k, rel=1e-5) and acc_a == acc_k
    # ...and batch 1 without accumulation is a different run (150 samples: 37 full windows + a flush).
    assert abs(results["batch1"][-1][0] - results["batchk"][-1][0]) > 1e-3
