"""benchmarks.peer: end to end at a tiny shape (TensorFlow and JAX), its argument checks,
and the table built from workers' results (peer rows included, without torch)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import peer
from benchmarks.harness import GiB, MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TensorFlow's CPU allocator does not count tensors of a few KiB: hidden 128 and seq 64
# is about the smallest shape whose per-sample memory it sees.
TINY = ["--layers", "2", "--hidden", "128", "--heads", "2", "--ffn", "256", "--seq", "128",
        "--vocab", "1000", "--batches", "2,8", "--steps", "2"]
PEER = importlib.util.find_spec("torch") is not None and \
    importlib.util.find_spec("transformers") is not None


def _run(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks.peer", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.slow(seconds=130)
@pytest.mark.parametrize("backend, policies", [("tensorflow", ("0", "full")),
                                               ("jax", ("0", "full"))])
def test_peer_end_to_end(tmp_path, backend, policies):
    """Every configuration is a fresh process (keras-hub's import alone is seconds):
    RECOMPUTE=0 and "full" on each backend (a policy row runs the same code for either
    policy: `patch(policy=...)`, whose policies the recompute suites compare with their
    references)."""
    out_json = tmp_path / "peer.json"
    extra = ["--no-peer"] if PEER else []  # torch absent: the tool skips the peer by itself
    out = _run([*TINY, "--policies", ",".join(policies), "--json", str(out_json), *extra],
               env=dict(KERAS_BACKEND=backend), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[benchmarks.peer]" in out.stderr  # progress lines
    lines = out.stdout.splitlines()
    labels = {"0": "keras-hub RECOMPUTE=0", "attention": 'patch(policy="attention")',
              "full": "patch() (full)"}
    for policy, label in labels.items():
        assert sum(line.startswith(label) for line in lines) == (policy in policies), out.stdout
    assert f"on Keras 3 {backend}" in out.stdout
    assert "ignoring weights, gradients and optimizer state" in out.stdout
    skipped = "--no-peer" if PEER else "torch and transformers are not importable"
    assert lines[-1] == f"peer rows skipped: {skipped}"
    assert not any(line.startswith("torch ") for line in lines)

    result = json.loads(out_json.read_text())
    assert result["config"]["backend"] == backend and result["peer_skipped"] == skipped
    runs = {(r["row"], r["batch"]): r for r in result["results"]}
    assert set(runs) == {(row, b) for row in policies for b in (2, 8)}
    for (row, _), r in runs.items():
        assert r["side"] == "project" and not r.get("oom")
        assert r["recompute_enabled"] is (row != "0")
    rows = {e["row"]: e for e in result["rows"]}
    # Same seed, same data: recomputation changes the memory, not the loss.
    base = rows["0"]["first_loss"]
    for row in policies[1:]:
        assert abs(rows[row]["first_loss"] - base) <= 1e-5 * abs(base), (row, rows[row])
    assert runs["0", 2]["first_loss"] == base
    # Full recomputation keeps less per sample.
    assert 0 < rows["full"]["per_sample_bytes"] < rows["0"]["per_sample_bytes"]
    assert rows["full"]["saved"] > 1 and rows["0"]["saved"] == 1.0
    assert rows["full"]["budget_batch"] == int(16 * GiB // rows["full"]["per_sample_bytes"])
    expected = "TensorFlow's allocator of CPU:0" if backend == "tensorflow" else "saved residuals"
    assert expected in rows["0"]["measure"]


@pytest.mark.parametrize("args, message", [
    (["--seq", "0"], "`--seq` must be an integer >= 1. Received: --seq=0"),
    (["--layers", "two"], "`--layers` must be an integer >= 1. Received: --layers=two"),
    (["--steps", "-1"], "`--steps` must be an integer >= 1. Received: --steps=-1"),
    (["--batches", "8"], "`--batches` must be at least 2 distinct integers >= 1, comma-separated "
                         "(e.g. 8,32). Received: --batches=8"),
    (["--batches", "8,8"], "Received: --batches=8,8"),
    (["--precision", "fp16"], "`--precision` must be one of fp32, tf32, bf16. "
                              "Received: --precision=fp16"),
    (["--model", "lean"], "`--model` must be one of hub, standard. Received: --model=lean"),
    (["--policies", "0,layer"], "`--policies` must be distinct items of 0, attention, full, "
                                "comma-separated. Received: --policies=0,layer"),
    (["--budget-gib", "0"], "`--budget-gib` must be a number > 0. Received: --budget-gib=0"),
    (["--dropout", "1"], "`--dropout` must be a number in [0, 1). Received: --dropout=1"),
    (["--hidden", "64", "--heads", "3"], "`--hidden` must be divisible by `--heads`. "
                                         "Received: --hidden=64, --heads=3"),
])
def test_peer_rejects_bad_arguments(args, message):
    out = _run(args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "[benchmarks.peer]" not in out.stderr  # refused before any worker started


def test_make_batch_pads_the_last_quarter():
    ids, mask, labels = peer.make_batch(3, 16, 50, seed=0)
    assert ids.shape == mask.shape == (3, 16) and labels.shape == (3,)
    assert (mask[:, :12] == 1).all() and (mask[:, 12:] == 0).all()
    assert (ids[:, 12:] == 0).all() and (ids[:, :12] >= 1).all() and (ids < 50).all()
    again = peer.make_batch(3, 16, 50, seed=0)
    for a, b in zip((ids, mask, labels), again):
        np.testing.assert_array_equal(a, b)


def _result(side, row, batch, mib, step_s, loss):
    return dict(side=side, row=row, batch=batch, memory_bytes=int(mib * MiB), step_s=step_s,
                first_loss=loss, measure=f"{side} measure")


def test_table_from_results_with_peer_rows():
    """`summarize` and `format_table` on made-up results: slopes, ratios to each row's
    baseline, the batch in the budget, OOM and failed workers."""
    rows = [("project", p, "0") for p in ("0", "attention", "full")]
    rows += [("peer", peer.peer_row_name(*r), peer.peer_row_name(r[0], False))
             for r in peer.PEER_ROWS]
    mib = {  # (side, row) -> MiB at batch 8, 32
        ("project", "0"): (2000, 8000), ("project", "attention"): (1400, 5000),
        ("project", "full"): (500, 1100), ("peer", "sdpa"): (2100, 9800),
        ("peer", "sdpa + checkpointing"): (430, 1230), ("peer", "eager"): (4600, None),
        ("peer", "eager + checkpointing"): (420, None)}
    results = {}
    for (side, row), (m8, m32) in mib.items():
        results[side, row, 8] = _result(side, row, 8, m8, 0.1, 0.6)
        results[side, row, 32] = None if m32 is None else _result(side, row, 32, m32, 0.2, 0.7)
    results["peer", "eager", 32] = dict(side="peer", row="eager", batch=32, oom=True,
                                        error="CUDA out of memory")
    results["project", "full", 32]["step_s"] = 0.25
    entries = peer.summarize(results, rows, (8, 32), 16 * GiB)
    by_row = {(e["side"], e["row"]): e for e in entries}
    base, full = by_row["project", "0"], by_row["project", "full"]
    assert base["per_sample_bytes"] == pytest.approx(250 * MiB)
    assert full["per_sample_bytes"] == pytest.approx(25 * MiB)
    assert full["saved"] == pytest.approx(10.0) and full["time_ratio"] == pytest.approx(1.25)
    assert base["saved"] == 1.0 and base["budget_batch"] == 65
    assert full["budget_batch"] == 655  # floor(16384 / 25)
    sdpa_ckpt = by_row["peer", "sdpa + checkpointing"]
    assert sdpa_ckpt["saved"] == pytest.approx(((9800 - 2100) / 24) / ((1230 - 430) / 24))
    assert by_row["peer", "eager"]["status"] == "OOM at batch 32"
    assert by_row["peer", "eager"]["first_loss"] == 0.6  # from the smallest batch
    assert by_row["peer", "eager + checkpointing"]["status"] == "failed at batch 32"
    assert by_row["peer", "eager + checkpointing"]["saved"] is None

    lines = peer.format_table(entries, 16.0)
    assert "batch in 16 GiB" in lines[0] and "first loss" in lines[0]
    table = {line[:42].rstrip(): line[42:].split() for line in lines[1:]}
    assert table["keras-hub RECOMPUTE=0"] == ["250.0", "x1.00", "0.200", "x1.00", "65", "0.600000"]
    assert table["patch() (full)"] == ["25.0", "x10.00", "0.250", "x1.25", "655", "0.600000"]
    assert table['patch(policy="attention")'][:2] == ["150.0", "x1.67"]
    assert table["torch sdpa"][0] == f"{(9800 - 2100) / 24:.1f}"
    assert table["torch eager"] == ["OOM", "@", "32", "-", "-", "-", "-", "0.600000"]
    assert table["torch eager + checkpointing"][:3] == ["failed", "@", "32"]
    # The standard block's rows are named by their policy.
    assert peer.row_label("project", "attention", "standard") == "standard attention"


def test_peer_available_names_what_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert peer.peer_available() == (False, "torch is not importable") or \
        peer.peer_available() == (False, "torch and transformers are not importable")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert peer.peer_available() == (False, "torch and transformers are not importable")
