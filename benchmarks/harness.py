"""What the benchmarks share: fresh worker processes, memory readings, argument types.

Nothing here imports TensorFlow at module level (the parents of the
benchmarks stay light); `allocator_step` imports it when called.

- Fresh processes: `run_workers` starts `python -m benchmarks.<tool> --worker
  ... --out PATH` (one process, or a `MultiWorkerMirroredStrategy` cluster with
  `tf_config_envs`), forwards the workers' progress lines, polls their peak RSS,
  kills them past an RSS limit or a timeout (all of a cluster when one fails),
  and returns each worker's JSON result. The worker side: `write_result`,
  `hold_then_exit`, `RssWatchdog`.
- Memory: `peak_rss_kib` (VmHWM of this process), `proc_status_kib`,
  `mem_available_bytes`, `allocator_step` (TensorFlow's allocator peak of one
  step, `tf.config.experimental.get_memory_info`; workers need `allocator_env`).
- Command lines: `positive_int`, `positive_float`, `float_above`,
  `fraction`, `int_list`, `name_list` (argparse types whose errors say what
  was expected and what was received).
- Figures: `MiB`, `GiB`, `slope` (least squares), `lower_median`.
- `Progress`: "[benchmarks.<tool>] ..." lines on stderr.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

MiB = 1024.0 * 1024.0
GiB = 1024.0 * MiB
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------
# Progress lines.


class Progress:
    """Prints "[<module>] message" to stderr; `run_workers` forwards a worker's such lines."""

    def __init__(self, module):
        self.module = module
        self.prefix = f"[{module}]"

    def __call__(self, message):
        print(f"{self.prefix} {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Memory readings.


def proc_status_kib(pid, field):
    """`field` (e.g. "VmRSS", "VmHWM") of /proc/<pid>/status in KiB, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def peak_rss_kib():
    """Peak resident memory of this process (VmHWM; `ru_maxrss` where /proc has none), in KiB."""
    hwm = proc_status_kib("self", "VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def mem_available_bytes():
    """MemAvailable of /proc/meminfo in bytes, or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def allocator_env():
    """Worker environment for `allocator_step`: TF_ENABLE_ONEDNN_OPTS=1 unless set.

    TensorFlow's CPU allocator keeps statistics only with oneDNN, which is on
    by default only on CPUs with AVX-512.
    """
    return {"TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1")}


def allocator_step(fn, device="CPU:0"):
    """Runs `fn()` once; returns (its value, allocator peak bytes, CPU s, wall s).

    The allocator figure is TensorFlow's peak on `device` during the call
    minus its `current` bytes just before it (stats reset first): what the
    step allocated on top of what was alive. CPU seconds are
    `time.process_time` (all threads). Raises RuntimeError where the
    allocator keeps no statistics (see `allocator_env`).
    """
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as e:
        raise RuntimeError(
            f"TensorFlow's allocator of {device} keeps no statistics ({e}); on CPU they need "
            f"oneDNN: TF_ENABLE_ONEDNN_OPTS=1. Received: "
            f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')!r}") from None
    before = tf.config.experimental.get_memory_info(device)["current"]
    c0, w0 = time.process_time(), time.perf_counter()
    value = fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return value, peak - before, cpu, wall


# --------------------------------------------------------------------------
# Figures.


def slope(points):
    """Least-squares slope and intercept of [(x, y)]."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    s = sum((x - mx) * (y - my) for x, y in points) / sxx
    return s, my - s * mx


def lower_median(values):
    """The median of `values`; of an even count, the lower of the middle two (a measured value)."""
    return sorted(values)[(len(values) - 1) // 2]


# --------------------------------------------------------------------------
# Argument types (argparse adds "--flag: " in front of the messages).


def _number(text, convert, accept, expected):
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text):
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text):
    # `v > 0` also rejects nan.
    return _number(text, float, lambda v: v > 0 and v != float("inf"), "a positive number")


def float_above(bound):
    """Type: a finite number > `bound`."""
    return lambda text: _number(text, float, lambda v: bound < v < float("inf"),
                                f"a number > {bound:g}")


def fraction(text):
    """Type: a number in [0, 1) (a dropout rate)."""
    return _number(text, float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")


def _items(text):
    return [t for t in text.replace(" ", "").split(",") if t]


def int_list(text):
    """Type: comma-separated distinct positive integers such as "2,6" -> (2, 6)."""
    try:
        values = [int(t) for t in _items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 2,6, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 2,6, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
    return tuple(values)


def name_list(names, expected=None):
    """Type: comma-separated distinct names from `names` -> a tuple."""
    expected = expected or f"a comma-separated list of distinct names from {','.join(names)}"

    def parse(text):
        values = _items(text)
        if not values or any(v not in names for v in values) or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return tuple(values)

    return parse


def add_worker_arguments(parser):
    """The hidden options by which `run_workers` starts a worker: `--worker`, `--out PATH`."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def existing_folder(parser, flag, path):
    """`parser.error` unless the folder `path` would be written to exists."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag}: directory {folder!r} does not exist")


# --------------------------------------------------------------------------
# Fresh worker processes: the parent side.


def free_ports(n):
    """`n` distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config_envs(n):
    """Per-worker environments of an `n`-worker `MultiWorkerMirroredStrategy` cluster on loopback."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(n)]}
    return [dict(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
            for i in range(n)]


def worker_env(**overrides):
    """This environment with the checkout first on PYTHONPATH, quiet TensorFlow
    (TF_CPP_MIN_LOG_LEVEL=2 unless set) and KERAS_BACKEND=tensorflow unless set,
    then `overrides` (a value None removes the variable)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        [CHECKOUT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class WorkerRun:
    """One worker's outcome. `result`: its JSON result (None if it wrote none);
    `code`: exit code (negative: killed by that signal); `peak_rss_kib`: its
    VmHWM as the parent polled it; `killed`: why the parent killed it
    ("memory", "timeout", "peer": another worker of the cluster failed) or
    None; `tail`: its last stderr lines that were not progress lines."""

    index: int
    code: int
    result: dict
    peak_rss_kib: int
    killed: str
    tail: str

    def failure(self, timeout=None):
        """Why this worker gave no result, in words."""
        if self.killed == "timeout":
            return f"did not finish within {timeout:.0f} s"
        if self.killed == "memory":
            return "killed by the parent's memory backstop"
        if self.code is not None and self.code < 0:
            return f"killed by signal {-self.code}"
        return f"failed with exit code {self.code}"


def run_workers(progress, argv, envs, timeout=None, rss_abort_bytes=None):
    """Runs `python -m <progress.module> --worker <argv> --out PATH`, a process per entry of `envs`.

    Each worker gets `worker_env(**envs[i])` and its own result file, which
    it writes with `write_result`. Its stdout is discarded; its stderr lines
    starting with `progress.prefix` are forwarded, the rest kept as `tail`.
    The parent polls every worker's VmRSS/VmHWM; it kills a worker whose RSS
    passes `rss_abort_bytes`, every worker when `timeout` seconds pass, and,
    with several workers (a cluster: each would wait for the others in an
    all-reduce), every worker once one exits without a result. When every
    worker has written its result, their stdin is closed (the signal for
    `hold_then_exit`). Returns a `WorkerRun` per worker.
    """
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"result{i}.json") for i in range(len(envs))]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", progress.module, "--worker", *argv, "--out", out],
                env=worker_env(**env), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True)
            for env, out in zip(envs, outs)
        ]
        tails = [[] for _ in procs]

        def read_stderr(proc, tail):
            for line in proc.stderr:
                if line.startswith(progress.prefix):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    tail[:] = (tail + [line])[-40:]

        readers = [threading.Thread(target=read_stderr, args=(p, t), daemon=True)
                   for p, t in zip(procs, tails)]
        for r in readers:
            r.start()
        hwm, killed = [0] * len(procs), [None] * len(procs)
        deadline = None if timeout is None else time.monotonic() + timeout

        def kill(i, why):
            if procs[i].poll() is None:
                killed[i] = why
                procs[i].send_signal(signal.SIGKILL)

        try:
            while True:
                for i, p in enumerate(procs):
                    rss = proc_status_kib(p.pid, "VmRSS")
                    # The peak is read after the current size, and is at least it: the
                    # peak reported for a worker killed over the limit is over the limit.
                    hwm[i] = max(hwm[i], proc_status_kib(p.pid, "VmHWM") or 0, rss or 0)
                    if rss_abort_bytes and rss and rss * 1024 > rss_abort_bytes:
                        kill(i, "memory")
                finished = [p.poll() is not None for p in procs]
                written = [os.path.exists(out) for out in outs]
                if all(f or w for f, w in zip(finished, written)):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    for i in range(len(procs)):
                        kill(i, "timeout")
                    break
                if len(procs) > 1 and any(f and not w for f, w in zip(finished, written)):
                    for i in range(len(procs)):
                        kill(i, "peer")
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                try:
                    p.stdin.close()  # the workers may leave now
                except OSError:
                    pass
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    kill(i, killed[i] or "timeout")
                    p.wait()
            for r in readers:
                r.join(5.0)
        runs = []
        for i, (p, out) in enumerate(zip(procs, outs)):
            result = None
            if os.path.exists(out):
                with open(out) as f:
                    result = json.load(f)
            runs.append(WorkerRun(i, p.returncode, result, hwm[i], killed[i], "".join(tails[i])))
        return runs


def require_results(runs, what, timeout=None):
    """The workers' results; if one gave none, writes its stderr tail and raises RuntimeError."""
    failed = [r for r in runs if r.result is None and r.killed != "peer"]
    failed = failed or [r for r in runs if r.result is None]
    if not failed:
        return [r.result for r in runs]
    r = failed[0]
    sys.stderr.write(r.tail)
    who = f"{what}: worker {r.index}" if len(runs) > 1 else what
    raise RuntimeError(f"{who} {r.failure(timeout)} (its last stderr lines are above)")


# --------------------------------------------------------------------------
# Fresh worker processes: the worker side.


def write_result(path, result):
    """Writes `result` as JSON to `path` at once (the parent never reads half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def hold_then_exit():
    """Waits until the parent closes stdin (it has every worker's result), then leaves
    without the interpreter's teardown, where TensorFlow's collective runtime may crash.

    A cluster worker that left at once could close its sockets while another
    still receives the last all-reduce from it.
    """
    sys.stdin.read()
    os._exit(0)


def task_index():
    """This worker's index in TF_CONFIG."""
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


class RssWatchdog(threading.Thread):
    """Worker-side guard: exits the process as soon as its RSS passes `limit_bytes`.

    TensorFlow releases the GIL while it runs a step, so this thread keeps
    polling VmRSS (every 10 ms) during the step. On a breach it writes
    `dict(result, **on_breach)` plus `aborted`, `peak_rss_mib` and `error` to
    `out_path` and leaves with `os._exit(3)`: a large candidate can take a
    bounded share of the machine, not all of it. (`RLIMIT_AS` is no use:
    TensorFlow reserves far more address space than it touches.) `result` is
    read at the breach, so the worker may keep filling it.
    """

    def __init__(self, limit_bytes, out_path, result, **on_breach):
        super().__init__(daemon=True)
        self.limit_bytes = limit_bytes
        self.out_path = out_path
        self.result = result
        self.on_breach = on_breach

    def run(self):
        pid = os.getpid()
        while True:
            rss = proc_status_kib(pid, "VmRSS")
            if rss is not None and rss * 1024 > self.limit_bytes:
                result = dict(self.result, **self.on_breach, aborted=True,
                              peak_rss_mib=(peak_rss_kib() or rss) / 1024.0,
                              error=f"RSS {rss / 1024:.0f} MiB passed the abort limit "
                                    f"{self.limit_bytes / MiB:.0f} MiB")
                try:
                    write_result(self.out_path, result)
                finally:
                    os._exit(3)
            time.sleep(0.01)
