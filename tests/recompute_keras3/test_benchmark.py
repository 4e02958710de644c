"""benchmarks.recompute_memory runs end to end (quick shape) and its figures are consistent."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_benchmark(tmp_path):
    out_json = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--quick", "--model", "standard",
         "--batch-sizes", "2,4", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory 0/mode" in out.stdout
    assert "[benchmarks.recompute_memory]" in out.stderr  # progress lines
    result = json.loads(out_json.read_text())
    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    assert set(runs) == {(m, b) for m in ("0", "full", "attention") for b in (2, 4)}
    assert set(result["ratios"]) == {"full", "attention"}
    for batch in (2, 4):
        for policy in ("full", "attention"):
            on, off = runs[(policy, batch)], runs[("0", batch)]
            assert on["recompute"] == "1" and off["recompute"] == "0"
            # Same seed, same data: recomputation changes nothing but memory and time
            # ("full" bit for bit; "attention"'s lean core takes its gradients by other
            # ops, so the loss after the warm-up updates equals to rounding).
            if policy == "full":
                assert on["loss"] == off["loss"]
            else:
                assert abs(on["loss"] - off["loss"]) <= 1e-5 * abs(off["loss"])
            # It does save activation memory, even on the tiny shape.
            assert on["activation_bytes"] < off["activation_bytes"]


def test_benchmark_rejects_bad_arguments():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.recompute_memory", "--layers", "0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 2
    assert "--layers: expected a positive integer, got '0'" in out.stderr
