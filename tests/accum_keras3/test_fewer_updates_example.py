"""examples/fewer_updates.py: a tiny run (table, JSON, PNG), and arm b keeps Adam's β unchanged."""

import importlib.util
import json
import math
import os

import keras
import numpy as np
import pytest

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (test extra)")
pytest.importorskip("matplotlib", reason="the example draws a PNG with matplotlib")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fewer_updates.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("fewer_updates", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_run_reports_four_arms(example, tmp_path, capsys):
    png, out = tmp_path / "f.png", tmp_path / "f.json"
    results = example.main(["--limit", "200", "--epochs", "1", "--seeds", "2", "--k", "4",
                            "--out-png", str(png), "--json", str(out)])
    printed = capsys.readouterr().out
    labels = example.labels(4, 1)
    rows = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| arm |")]
    assert [row.split(" | ")[0][2:] for row in rows] == [labels[arm] for arm in example.ARMS]
    saved = json.loads(out.read_text())
    assert list(saved["arms"]) == list(example.ARMS) == list(results)
    for arm in example.ARMS:
        for figure in ("final_accuracy", "final_loss"):
            assert all(math.isfinite(v) for v in saved["arms"][arm][figure].values())
        assert len(saved["arms"][arm]["per_seed"]) == 2
        assert all(len(h["accuracy"]) == 2 for h in saved["arms"][arm]["per_seed"])  # before + 1 epoch
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_kth_arm_keeps_beta_unchanged(example):
    """k micro-steps of a constant gradient from zero slots: the moments are plain
    Adam's (original β) after k steps, and the weights move at the k-th only, by
    Adam's step with the original β's bias corrections (m̂ = g, v̂ = g²)."""
    k, lr = 8, 0.01
    g = np.array([0.5, -0.25, 2.0], "float32")
    w0 = np.array([1.0, 2.0, 3.0], "float32")
    var, plain_var = keras.Variable(w0), keras.Variable(w0)
    opt = example.unchanged_beta_adam(k, lr)
    plain = keras.optimizers.Adam(lr)  # beta_1=0.9, beta_2=0.999
    opt.build([var])
    plain.build([plain_var])
    for step in range(1, k + 1):
        opt.apply_gradients([(g, var)])
        plain.apply_gradients([(g, plain_var)])
        if step < k:
            np.testing.assert_array_equal(var.numpy(), w0)
    inner = opt.inner_optimizer
    np.testing.assert_allclose(inner._momentums[0].numpy(), plain._momentums[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(inner._velocities[0].numpy(), plain._velocities[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(inner._momentums[0].numpy(), (1 - 0.9**k) * g, rtol=1e-6)
    np.testing.assert_allclose(var.numpy(), w0 - lr * np.sign(g), rtol=1e-6)
    assert int(inner.iterations) == 1 and int(opt.micro_steps) == k


def test_k_too_large_for_beta_1_is_refused(example, capsys):
    example.unchanged_beta_adam(10, 1e-3)  # beta_1' = 1 - 10 * 0.1 = 0: the largest k
    with pytest.raises(ValueError, match=r"k=11 is too large to keep beta_1=0.9 unchanged.*Use k <= 10"):
        example.unchanged_beta_adam(11, 1e-3)
    with pytest.raises(SystemExit):
        example.main(["--k", "12"])
    assert "--k: k=12 is too large to keep beta_1=0.9 unchanged" in capsys.readouterr().err
