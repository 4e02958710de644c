"""benchmarks.accum_local_jax runs end to end (quick shape, 4 virtual devices) and its
all-reduce counts are those of the two steps: every gradient on every micro-step
(Keras's), every gradient once per update (`accum.local_gradients`)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_benchmark(tmp_path):
    out = tmp_path / "local.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.accum_local_jax", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    parameters, reductions = result["parameters"], result["reductions"]
    assert reductions["keras"] == {"every_step_floats": parameters + 1, "update_only_floats": 0}
    assert reductions["local"]["update_only_floats"] == parameters
    assert reductions["local"]["every_step_floats"] <= 3
    assert len(result["times"]["local"]["wall"]) == result["args"]["updates"] == 3
    assert result["weights_max_rel_difference"] < 1e-4
    assert "| local |" in proc.stdout
