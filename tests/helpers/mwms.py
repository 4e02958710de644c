"""Runs `python -m tests.helpers.mwms_worker` as 2 `MultiWorkerMirroredStrategy` workers on loopback (TF_CONFIG), bounded in time."""

import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.harness import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
WORKER = "tests.helpers.mwms_worker"  # AccumOptimizer
RECOMPUTE_WORKER = "tests.helpers.mwms_recompute_worker"  # recompute_grad


def run_workers(scenario, out_dir, workers=2, timeout=120.0, extra_env=None, worker=WORKER):
    """Starts `workers` processes of `worker <scenario> <out_dir>` (a module; default:
    `tests.helpers.mwms_worker`), waits for all.

    Each process gets `TF_CONFIG` for its task. If any fails or the time is
    up, all of them are killed and an `AssertionError` carries their output.
    Returns the list of the workers' `np.load`ed results (`out_dir/worker<i>.npz`).
    """
    ports = free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs, logs = [], []
    for index in range(workers):
        env = dict(os.environ)
        env.update(extra_env or {})
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["CUDA_VISIBLE_DEVICES"] = ""
        log = open(os.path.join(out_dir, f"worker{index}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", worker, scenario, str(out_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        ))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = f"worker {bad[0]} exited with {procs[bad[0]].returncode}"
                break
            time.sleep(0.1)
        else:
            codes = [p.returncode for p in procs]
            if any(codes):
                failed = f"exit codes {codes}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-4000:])
        log.close()
    if failed:
        raise AssertionError(f"MultiWorkerMirroredStrategy workers: {failed}\n" + "\n".join(
            f"--- worker {i} ---\n{out}" for i, out in enumerate(outputs)))
    return [dict(np.load(os.path.join(out_dir, f"worker{i}.npz"))) for i in range(workers)]


def weights(result, key):
    """The list of arrays `key_0, key_1, ...` of one worker's result."""
    n = sum(1 for name in result if name.startswith(f"{key}_") and name[len(key) + 1:].isdigit())
    return [result[f"{key}_{i}"] for i in range(n)]
