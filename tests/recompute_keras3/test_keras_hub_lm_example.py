"""examples/keras_hub_lm_finetune.py at a tiny size on both backends: it measures RECOMPUTE off
and on, trains the LoRA factors through AccumOptimizer (every update done, the frozen weights
unchanged, exit status 0) and prints what its docstring says; bad sizes are refused."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("keras_hub")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "keras_hub_lm_finetune.py"


def run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "RECOMPUTE")}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow  # a fresh process per backend (imports: ~15 s each)
@pytest.mark.parametrize("backend, model", [("tensorflow", "gemma"), ("jax", "llama")])
def test_tiny_lora_fine_tune(backend, model):
    out = run("--backend", backend, "--model", model, "--hidden", "16", "--heads", "2", "--seq", "8",
              "--batch-size", "2", "--updates", "2", "--rank", "2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"causal LM on Keras 3 / {backend}: 2 blocks recomputed (2 covered)" in out.stdout
    assert "RECOMPUTE=0:" in out.stdout and "RECOMPUTE=1:" in out.stdout
    assert "updates    2/2: loss" in out.stdout
    assert "frozen weights unchanged: True; weight updates: 2" in out.stdout


def test_bad_sizes_are_refused():
    out = run("--seq", "7")
    assert out.returncode == 2 and "--seq must be an even number >= 4. Received: 7" in out.stderr

