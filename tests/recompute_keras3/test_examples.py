"""The examples run and show what they claim."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_recompute_fit_example_trains_identically():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "recompute_fit.py"),
         "--blocks", "2", "--samples", "64", "--epochs", "1", "--hidden", "32"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = [l for l in out.stdout.splitlines() if "max relative weight difference" in l][-1]
    assert float(line.rsplit(":", 1)[1]) <= 1e-5, out.stdout  # float rounding


def test_recompute_fit_example_rejects_bad_arguments():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "recompute_fit.py"), "--heads", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 2
    assert "--hidden must be a multiple of --heads. Received: 64 and 3" in out.stderr
