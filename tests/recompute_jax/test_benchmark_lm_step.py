"""benchmarks.lm_step runs end to end on a tiny Gemma (every mode compiled and stepped in
one fresh process) and its losses are equal across the modes to float32 rounding (learning
rate 0: every step sees the same weights, and recomputation and the chunked loss are exact;
float32 pinned, so the check holds on a GPU too); `--target` plans for a GPU without
running; other backends are refused."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, backend="jax"):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_DEFAULT_MATMUL_PRECISION="highest")
    return subprocess.run([sys.executable, "-m", "benchmarks.lm_step", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.slow  # compiles and steps every mode in a fresh process
def test_tiny_step_every_mode(tmp_path):
    out = tmp_path / "step.json"
    proc = _run(["--model", "tiny", "--seq", "32", "--vocab", "500", "--layers", "2",
                 "--modes", "0,attention,full,chunked", "--steps", "2", "--dtype", "float32",
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["config"]["layers"] == 2 and result["config"]["dtype"] == "float32"
    modes = result["modes"]
    assert set(modes) == {"0", "attention", "full", "chunked"}
    losses = {mode: r["losses"] for mode, r in modes.items()}
    assert all(len(v) == 2 for v in losses.values()), losses
    first = losses["0"][0]
    assert all(loss == pytest.approx(first, rel=1e-6) for v in losses.values() for loss in v), losses
    assert all(r["plan_bytes"] > result["weights_bytes"] for r in modes.values())
    assert '| `"full"` |' in proc.stdout and "| RECOMPUTE=0 |" in proc.stdout
    assert '| `"full"` + `chunked_loss` |' in proc.stdout
    assert result["config"]["chunk_tokens"] > 0


@pytest.mark.slow  # compiles every mode for XLA:GPU in a fresh process
def test_target_plans_without_running(tmp_path):
    out = tmp_path / "plan.json"
    proc = _run(["--target", "h100", "--model", "tiny", "--seq", "64", "--vocab", "4000",
                 "--layers", "2", "--modes", "full,chunked", "--chunk-tokens", "16",
                 "--dtype", "float32", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["config"]["target"] == "h100" and result["config"]["chunk_tokens"] == 16
    modes = result["modes"]
    assert all("losses" not in r and r["plan_bytes"] > result["weights_bytes"]
               for r in modes.values()), modes
    # 64 tokens x 4000 words: the full logits (1 MiB in float32, and their gradient) are the
    # step's largest temporaries at this size; chunks of 16 tokens keep a quarter of them.
    assert modes["chunked"]["temp_bytes"] < modes["full"]["temp_bytes"], modes
    assert "nothing ran" in proc.stdout


def test_refuses_other_backends():
    proc = _run(["--model", "tiny"], backend="tensorflow")
    assert proc.returncode == 2
    assert "KERAS_BACKEND=jax" in proc.stderr and "Received: KERAS_BACKEND=tensorflow" in proc.stderr
