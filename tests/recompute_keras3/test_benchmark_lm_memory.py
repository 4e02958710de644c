"""benchmarks.lm_memory: its arguments, its fits and projections, and tiny end-to-end runs."""

import json
import subprocess
import sys

import pytest

from benchmarks import lm_memory
from benchmarks.harness import MiB


def test_bad_arguments_are_refused(capsys):
    for argv, message in (
        (["--layers", "2"], "give at least 2 --batch-sizes and 2 --layers. Received: "
                            "--batch-sizes=1,2 --layers=2"),
        (["--paired", "--seqs", "1024,2048"], "--paired measures one seq and one block count"),
        (["--modes", "full,bad"], "expected a comma-separated list of distinct names from "
                                  "0,attention,full, got 'full,bad'"),
        (["--model", "gpt"], "invalid choice: 'gpt'"),
    ):
        with pytest.raises(SystemExit):
            lm_memory.parse_args(argv)
        assert message in capsys.readouterr().err


def _run(activation_mib, params=1000):
    return dict(activation_bytes=int(activation_mib * MiB), params=params, cpu_s_per_step=1.0)


def test_fit_separates_kept_per_block_from_once():
    # memory = 100 fixed + batch x (30 once + blocks x 50 kept), MiB
    runs = {(n, b): _run(100 + b * (30 + n * 50)) for n in (1, 2) for b in (1, 2)}
    f = lm_memory.fit(runs, "gemma-2b")
    assert f["per_sample"] == pytest.approx({1: 80.0, 2: 130.0}, abs=1e-5)
    assert f["kept"] == pytest.approx(50.0, abs=1e-5) and f["once"] == pytest.approx(30.0, abs=1e-5)
    assert f["projected"] == pytest.approx(18 * 50.0 + 30.0, abs=1e-4)  # Gemma-2B: 18 blocks
    runs[2, 2] = dict(failed="killed by the parent's memory backstop")
    f = lm_memory.fit(runs, "gemma-2b")
    assert f["per_sample"].keys() == {1} and f["kept"] is None and f["projected"] is None
    assert lm_memory.largest(runs) is None


def test_budget_counts_samples_and_tokens():
    fits = {1024: {"0": dict(projected=10 * 1024.0), "full": dict(projected=1024.0)},
            2048: {"0": dict(projected=30 * 1024.0), "full": dict(projected=None)}}
    rows = lm_memory.budget_rows([1024, 2048], fits, ["0", "full"], 24)
    assert rows[1024, "0"] == (2, 2048) and rows[1024, "full"] == (24, 24 * 1024)
    assert rows[2048, "0"] == (0, 0) and rows[2048, "full"] == (None, None)


@pytest.mark.slow
def test_tiny_paired_run(tmp_path):
    out = tmp_path / "paired.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_memory", "--model", "tiny", "--paired", "--seqs", "32",
         "--layers", "1", "--batch-sizes", "1", "--steps", "2", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"0", "attention", "full"}
    # Same weights, same batches, the same updates: recomputation changes no loss.
    for mode in ("attention", "full"):
        assert runs[mode]["loss"] == pytest.approx(runs["0"]["loss"], rel=1e-5)
        assert len(runs[mode]["cpu_s_per_step_each"]) == 2
    assert "mode/0 x" in done.stdout and "per 1000 tokens" in done.stdout
