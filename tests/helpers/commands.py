"""Runs a module of this repository as a command (`python -m ...`), as the benchmark
and example tests do; the environment of a fresh process that compiles XLA:GPU plans."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(module, *args, timeout=300):
    """`python -m module args` in the repository root: the finished process, its output as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def plan_env(**extra):
    """This process's environment, without `JAX_PLATFORMS` and `XLA_FLAGS`, plus `extra`: for a
    fresh process that compiles XLA:GPU plans (it names the CUDA platform itself, and the
    tests' XLA flags, `tests/conftest.py`, stay out of its plans)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(extra)
    return env
