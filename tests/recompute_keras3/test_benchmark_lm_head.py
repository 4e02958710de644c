"""`python -m benchmarks.lm_head` at a tiny size: full logits and `chunked_loss` train the same
model in paired rounds with equal losses, and the report says what it measured."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("keras_hub")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # one fresh process, two tiny models (~20 s)
def test_tiny_paired_run():
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "RECOMPUTE")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.lm_head", "--model", "tiny",
                          "--vocab", "1000", "--seq", "64", "--rounds", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[4].strip()
            for line in out.stdout.splitlines() if line.startswith("| full logits") or
            line.startswith("| chunked")}
    assert set(rows) == {"full logits", "chunked"}, out.stdout
    full, chunked = ([float(v) for v in rows[k].split(", ")] for k in ("full logits", "chunked"))
    assert len(full) == 3 and full == pytest.approx(chunked, rel=1e-5)
    assert "chunked saves" in out.stdout and "2 paired rounds" in out.stdout
