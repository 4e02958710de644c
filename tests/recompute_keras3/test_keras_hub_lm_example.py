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


@pytest.mark.slow(seconds=55)  # a fresh process per backend (imports: ~15 s each)
@pytest.mark.parametrize("backend, model, full_logits", [("tensorflow", "gemma", False),
                                                         ("jax", "llama", True)])
def test_tiny_lora_fine_tune(backend, model, full_logits):
    """The chunked loss (the default) on TensorFlow, `--full-logits` on JAX."""
    out = run("--backend", backend, "--model", model, "--hidden", "16", "--heads", "2", "--seq", "8",
              "--batch-size", "2", "--updates", "2", "--rank", "2",
              *(["--full-logits"] if full_logits else []))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"causal LM on Keras 3 / {backend}: 2 blocks recomputed (2 covered)" in out.stdout
    assert "RECOMPUTE=0:" in out.stdout and "RECOMPUTE=1:" in out.stdout
    assert "updates    2/2: loss" in out.stdout
    assert "frozen weights unchanged: True; weight updates: 2" in out.stdout
    if full_logits:
        assert "full logits: keras-hub's own head and loss" in out.stdout
        assert "chunked loss" not in out.stdout
    else:
        assert "chunked loss: the head's logits" in out.stdout
        assert "MiB saved per such tensor" in out.stdout


@pytest.mark.slow  # a fresh process
def test_every_update_is_trained_and_counted():
    """`--updates 7 --accum-steps 3`: 7 updates, each progress line the optimizer's own count (the
    example trained 6 and printed "7/7" when it split 21 micro-steps into 5 epochs of 4)."""
    out = run("--hidden", "16", "--heads", "2", "--seq", "8", "--batch-size", "2", "--layers", "1",
              "--updates", "7", "--accum-steps", "3", "--rank", "2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    counted = [line.split("/")[0].split()[-1] for line in out.stdout.splitlines()
               if line.startswith("  updates ")]
    assert counted == ["2", "4", "5", "6", "7"], out.stdout
    assert "weight updates: 7 of 7" in out.stdout
    assert "chunked loss: the head's logits 16 tokens at a time" in out.stdout  # the default


@pytest.mark.parametrize("updates, rounds, sizes", [
    (6, 5, [2, 1, 1, 1, 1]), (7, 5, [2, 2, 1, 1, 1]), (12, 5, [3, 3, 2, 2, 2]), (2, 2, [1, 1])])
def test_rounds_are_whole_updates(updates, rounds, sizes):
    import importlib.util

    spec = importlib.util.spec_from_file_location("keras_hub_lm_finetune", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.rounds(updates, rounds) == sizes


@pytest.mark.parametrize("args, message", [
    (("--seq", "7"), "--seq must be an even number >= 4. Received: 7"),
    (("--chunk-tokens", "0"), "--chunk-tokens must be >= 1. Received: 0"),
    (("--seed", "-1"), "--seed must be an integer >= 0. Received: -1"),
    (("--lr", "nan"), "--lr must be a finite number > 0. Received: nan"),
    (("--lr", "-1"), "--lr must be a finite number > 0. Received: -1.0"),
    (("--lr", "0"), "--lr must be a finite number > 0. Received: 0.0"),
    (("--lr", "inf"), "--lr must be a finite number > 0. Received: inf"),
    (("--rank", "1000", "--hidden", "16"),
     "--rank must be <= the head size --hidden / --heads = 4 (LoRA factors each projection per "
     "head; a higher rank adds weights, not rank). Received: 1000"),
])
def test_bad_arguments_are_refused(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]

