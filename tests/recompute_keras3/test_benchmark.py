"""benchmarks.recompute_memory runs end to end (quick shape) and its figures are consistent."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.commands import run_module

pytestmark = pytest.mark.slow(seconds=30)  # examples/benchmarks end to end: the newest Python in CI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_benchmark(tmp_path):
    """A fresh process per configuration: two modes (every mode runs in
    test_quick_paired_benchmark's one process)."""
    out_json = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--quick", "--model", "standard",
         "--modes", "0,full", "--batch-sizes", "2,4", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory 0/mode" in out.stdout
    assert "[benchmarks.recompute_memory]" in out.stderr  # progress lines
    result = json.loads(out_json.read_text())
    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    assert set(runs) == {(m, b) for m in ("0", "full") for b in (2, 4)}
    assert set(result["ratios"]) == {"full"}
    for batch in (2, 4):
        on, off = runs[("full", batch)], runs[("0", batch)]
        assert on["recompute"] == "1" and off["recompute"] == "0"
        # Same seed, same data: recomputation changes nothing but memory and time
        # (the blocked attention core sums in blocks: the loss after the warm-up
        # updates equals to rounding).
        assert abs(on["loss"] - off["loss"]) <= 1e-5 * abs(off["loss"])
        # It does save activation memory, even on the tiny shape.
        assert on["activation_bytes"] < off["activation_bytes"]


def test_benchmark_rejects_bad_arguments():
    out = run_module("benchmarks.recompute_memory", "--layers", "0")
    assert out.returncode == 2
    assert "--layers: expected a positive integer, got '0'" in out.stderr


def test_quick_paired_benchmark(tmp_path):
    """`--paired`: every configuration in one worker, the time ratio the median of the rounds'."""
    out_json = tmp_path / "paired.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--quick", "--model", "standard",
         "--layers", "2", "--batch-sizes", "2,4", "--steps", "3", "--paired", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--paired, 3 rounds" in out.stdout
    assert "median of the rounds" in out.stdout
    assert "in one fresh worker process" in out.stderr
    assert "warm-up round done" in out.stderr
    assert "round 3 of 3" in out.stderr
    result = json.loads(out_json.read_text())
    assert result["config"]["paired"] is True
    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    assert set(runs) == {(m, b) for m in ("0", "full", "attention") for b in (2, 4)}
    # One process: the same peak RSS everywhere, hence no RSS slope.
    assert len({r["rss_hwm_bytes"] for r in result["runs"]}) == 1
    assert all(s["rss_per_sample_bytes"] is None for s in result["summary"].values())
    for batch in (2, 4):
        off = runs[("0", batch)]
        assert off["paired"] and off["recompute_enabled"] is False
        for policy in ("full", "attention"):
            on = runs[(policy, batch)]
            assert on["recompute_enabled"] is True and len(on["cpu_s_per_step_each"]) == 3
            # Each model ran the same steps on the same batches: the losses agree.
            assert abs(on["loss"] - off["loss"]) <= 1e-5 * abs(off["loss"])
            assert on["activation_bytes"] < off["activation_bytes"]
            # The ratio is the median of the rounds' ratios, each from that round's steps.
            ratios = result["ratios"][policy]
            rounds = ratios["cpu_time_round_ratios"][str(batch)]
            assert rounds == [x / y for x, y in zip(on["cpu_s_per_step_each"],
                                                    off["cpu_s_per_step_each"])]
            assert ratios["cpu_time_on_over_off"][str(batch)] == sorted(rounds)[1]


def test_paired_refuses_jax():
    out = run_module("benchmarks.recompute_memory", "--backend", "jax", "--paired")
    assert out.returncode == 2
    assert "--paired measures TensorFlow's allocator and steps: it takes --backend tensorflow" \
        in out.stderr


def test_quick_benchmark_held(tmp_path):
    """`--held`: what the last measured step holds at its peak, from TensorFlow's allocation
    log. Its peak is the groups' sum, reads as the allocator's figure for the same step (the
    log counts tensors only, made in the step: within a quarter at this shape, as is the
    slope), and under "attention" a block's GELU input (the first feed-forward product,
    which the policy keeps) is held there."""
    out_json = tmp_path / "held.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--quick", "--model", "standard",
         "--modes", "attention", "--layers", "2", "--batch-sizes", "2,4", "--steps", "1",
         "--held", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held at the peak of the last measured step" in out.stdout
    assert "MemoryLogTensorAllocation" not in out.stderr  # the log went to its file
    result = json.loads(out_json.read_text())
    runs = {r["batch"]: r for r in result["runs"]}
    for run in runs.values():
        held = run["held"]
        assert held["peak_bytes"] == sum(size for size, _ in held["groups"].values())
        assert abs(held["peak_bytes"] - run["activation_bytes"]) <= 0.25 * run["activation_bytes"]
        kept = [g for g in held["groups"] if "ffn_in" in g and g.endswith("MatMul")]
        assert len(kept) == 1 and held["groups"][kept[0]][1] >= 1, held["groups"]
        # each such tensor is one block's [batch, seq, ffn] floats
        size, count = held["groups"][kept[0]]
        assert size == count * run["batch"] * 128 * 1024 * 4
    slope = (runs[4]["held"]["peak_bytes"] - runs[2]["held"]["peak_bytes"]) / 2
    allocator = result["summary"]["attention"]["per_sample_bytes"]
    assert abs(slope - allocator) <= 0.25 * allocator


def test_held_refuses_paired():
    out = run_module("benchmarks.recompute_memory", "--held", "--paired")
    assert out.returncode == 2
    assert "--held reads TensorFlow's allocation log in fresh processes" in out.stderr
