"""Runs a module of this repository as a command (`python -m ...`), as the benchmark
and example tests do."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(module, *args, timeout=300):
    """`python -m module args` in the repository root: the finished process, its output as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
