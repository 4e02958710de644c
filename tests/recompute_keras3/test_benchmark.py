"""benchmarks.recompute_memory runs end to end (quick shape) and its figures are consistent."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_benchmark(tmp_path):
    out_json = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--quick", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "activation memory per sample, off/on" in out.stdout
    assert "[benchmarks.recompute_memory]" in out.stderr  # progress lines
    result = json.loads(out_json.read_text())
    runs = {(r["recompute"], r["batch"]): r for r in result["runs"]}
    assert set(runs) == {("0", 2), ("0", 6), ("1", 2), ("1", 6)}
    for batch in (2, 6):
        # Same seed, same data: recomputation changes nothing but memory and time.
        assert runs[("0", batch)]["loss"] == runs[("1", batch)]["loss"]
        # It does save activation memory, even on the tiny shape.
        assert runs[("1", batch)]["activation_bytes"] < runs[("0", batch)]["activation_bytes"]


def test_benchmark_rejects_bad_arguments():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--layers", "0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 2
    assert "--layers: expected a positive integer, got '0'" in out.stderr
