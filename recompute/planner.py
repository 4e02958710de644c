"""The plan of a training run: the policy, the micro-batch and the accumulation steps, measured.

```python
plan = recompute.plan(build_model, x[:8], y[:8], effective_batch=256, budget_gib=4)
model = plan.build(build_model)           # build_model(plan.policy), optimizer in AccumOptimizer(k)
plan.fit(model, x, y, epochs=3)           # model.fit(batch_size=micro_batch) in recompute_scope
```

`plan(build_model, x, y, effective_batch, budget_gib=None)` builds the model once
per candidate policy (`build_model(policy)`: None, "attention", "full", in that
order), wraps its optimizer in `accum.AccumOptimizer(k=2)` (its buffers are part
of what is measured), and runs real training steps (recomputation on for a
policy) on rows of the sample batch (x, y), repeated as needed. On TensorFlow
the steps run as `fit` runs them, the train function on a dataset whose batch
dimension is unknown: one trace per candidate serves every micro-batch.

1. the line: after a first step and an update, unmeasured (the trace; the
   optimizer's state), one accumulating step at each of two small micro-batches
   (`batches`, default 2 and 4): peak = a + s * batch and seconds = c + t * batch
   through them;
2. the prediction: the largest divisor b of `effective_batch` with a + s * b
   within the budget (so k = effective_batch / b micro-batches make exactly one
   update), and the estimate (c + t * b) / b seconds per sample there;
3. a candidate whose estimate is over `SKIP_MARGIN` (1.1) times the time per
   sample measured for a candidate checked before is not checked (it cannot win);
   a policy that recomputes more than one checked before is not even built when
   that one's time per sample, less its time line's intercept spread over larger
   micro-batches, is within `SKIP_MARGIN` of the fastest measured (`_Planner.bounded`);
4. the check: a real updating step at b, then at the next divisor up while it
   fits, bisecting between the largest divisor measured to fit and the smallest
   measured not to until they are neighbours (the line can be far off). The step
   at the micro-batch kept is its timed step.

Each step's peak is read after a reset; its time is CPU seconds on a CPU (all
threads: steadier than wall seconds on a shared machine), wall seconds on a
GPU. The policy chosen is the one with the least measured time per sample among
those checked whose micro-batch fits.

On Keras's JAX backend (`memory="plan"`, its default) the steps are not run
but compiled: Keras's own jitted `train_step`, whose `memory_analysis()`
(arguments + outputs - aliases + temp) is the peak; the micro-batch kept is
then run for its time. With `target=` ("h100", "a100-40", "l4", "rtx4090") the
steps are compiled for that GPU on this machine (`recompute._xla_plan`) and
nothing runs: a plan, said to be one; the policy chosen is then the one that
recomputes least among those that fit.

The memory (`memory=`): "plan", XLA's plan (above); "allocator", TensorFlow's allocator peak
(`tf.config.experimental.get_memory_info`, reset before each batch; the
default with a GPU, whose budget defaults to TensorFlow's memory limit on it;
on a CPU it needs `TF_ENABLE_ONEDNN_OPTS=1` before TensorFlow is imported), or
"rss", the process's peak resident memory (VmHWM, reset through
/proc/self/clear_refs after `gc.collect()` and `malloc_trim`; the default on a
CPU, where `budget_gib` is required). Everything is measured in this process:
each candidate is a fresh model from `build_model`, the previous one dropped
and collected first; its stray memory (caches, allocator pools) is part of the
peak, which makes the plan err on the safe side.

The command (`python -m recompute.planner`, this module; `recompute.plan` is
the function) plans a keras-hub preset or a bert4keras checkpoint: see `main`.
"""

import ctypes
import dataclasses
import gc
import json
import os
import sys
import time

GiB = 1024.0 ** 3
MiB = 1024.0 ** 2
DEFAULT_POLICIES = (None, "attention", "full")
DEFAULT_BATCHES = (2, 4)
PREFIX = "[recompute.plan]"
# A candidate whose estimated time per sample is this many times the fastest measured so far
# is not checked (the estimate, from two small steps, is noisier than a measurement).
SKIP_MARGIN = 1.1


# --------------------------------------------------------------------------
# Checks of the arguments (Keras-style messages).


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool) or (
        type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu")


def _check_effective_batch(effective_batch):
    if not _is_int(effective_batch) or effective_batch < 1:
        raise ValueError("`effective_batch` must be an integer >= 1. "
                         f"Received: effective_batch={effective_batch!r}")
    return int(effective_batch)


def _check_batches(batches, effective_batch):
    batches = tuple(batches)
    if len(batches) != 2 or not all(_is_int(b) and b >= 1 for b in batches) or \
            batches[0] == batches[1]:
        raise ValueError("`batches` must be two different integers >= 1 (the micro-batches "
                         f"the line is measured at). Received: batches={batches!r}")
    batches = tuple(sorted(int(b) for b in batches))
    if effective_batch < batches[0]:
        raise ValueError(
            f"`effective_batch` must be at least the smallest micro-batch measured "
            f"(`batches`={batches}): lower `batches` to plan a smaller effective batch. "
            f"Received: effective_batch={effective_batch}")
    return batches


def _check_budget(budget_gib):
    if budget_gib is None:
        return None
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or \
            not 0 < budget_gib < float("inf"):
        raise ValueError(f"`budget_gib` must be a positive number of GiB. "
                         f"Received: budget_gib={budget_gib!r}")
    return float(budget_gib)


def divisors(n):
    """The divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_line(points):
    """(a, s) of the line peak = a + s * batch through [(batch, peak)] (least squares)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(p for _, p in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    s = sum((b - mx) * (p - my) for b, p in points) / sxx
    return my - s * mx, s


def predict(a, s, effective_batch, budget):
    """The largest divisor b of `effective_batch` with a + s * b <= budget, or None.

    A slope <= 0 (noise at tiny sizes) predicts that every divisor fits if a does."""
    fitting = [d for d in divisors(effective_batch) if a + max(s, 0.0) * d <= budget]
    return fitting[-1] if fitting else None


# --------------------------------------------------------------------------
# Memory meters.


class _Rss:
    """Peak resident memory of this process (VmHWM), reset through /proc/self/clear_refs."""

    name = "rss"
    what = "peak RSS (VmHWM)"

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as e:
            raise RuntimeError("`memory='rss'` needs Linux's /proc/self/clear_refs to reset the "
                               f"peak resident memory; it cannot be written here ({e}). Use "
                               "memory='allocator' on TensorFlow.") from None
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def reset(self):
        gc.collect()
        if self._trim is not None:
            self._trim(0)  # freed heap pages go back to the system, out of the next peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self, field="VmHWM"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def current(self):
        return self.peak("VmRSS")


class _TfAllocator:
    """TensorFlow's allocator peak on `device` ("GPU:0" or "CPU:0"), reset before each batch."""

    name = "allocator"

    def __init__(self, device):
        import tensorflow as tf

        self.device = device
        self.what = f"TensorFlow's {device} allocator peak"
        self._tf = tf
        try:
            tf.config.experimental.reset_memory_stats(device)
        except ValueError as e:
            raise RuntimeError(
                f"TensorFlow's allocator of {device} keeps no statistics here ({e}); on a CPU "
                "they need TF_ENABLE_ONEDNN_OPTS=1 set before TensorFlow is imported, or use "
                f"memory='rss'. Received: TF_ENABLE_ONEDNN_OPTS="
                f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS')!r}") from None

    def reset(self):
        gc.collect()
        self._tf.config.experimental.reset_memory_stats(self.device)

    def peak(self):
        return self._tf.config.experimental.get_memory_info(self.device)["peak"]

    def current(self):
        return self._tf.config.experimental.get_memory_info(self.device)["current"]


def _backend_of(model):
    """"tf_keras", or Keras 3's backend name."""
    if type(model).__module__.startswith("tf_keras") or any(
            c.__module__.startswith("tf_keras") for c in type(model).__mro__):
        return "tf_keras"
    import keras

    return keras.backend.backend()


def _tf_gpu():
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


class _XlaPlan:
    """XLA's plan of Keras's JAX training step (`memory_analysis()` of the compiled step:
    arguments + outputs - aliases + temp), compiled for `target` (a GPU this machine need
    not have: nothing runs, no time) or for JAX's local device (each step compiled is then
    also run, for its time; on a GPU the allocator's peak so far is recorded beside it)."""

    name = "plan"

    def __init__(self, target):
        from . import _xla_plan

        self.target = target
        if target is not None:
            self.sharding = _xla_plan.target_sharding(target)
            self.what = f"XLA's plan for {_xla_plan.TARGETS[target]['name']} (compiled, not run)"
        else:
            import jax

            self.sharding = None
            device = jax.devices()[0]
            self.what = (f"XLA's plan for the local {device.platform} device "
                         f"({getattr(device, 'device_kind', device.platform)}; compiled, "
                         "then run for its time)")

    def reset(self):
        gc.collect()

    def current(self):
        return 0.0  # nothing is allocated by a compilation

    def allocator_peak(self):
        """The local device's allocator peak so far (JAX cannot reset it), or None."""
        import jax

        stats = jax.devices()[0].memory_stats() if self.target is None else None
        return None if not stats else stats.get("peak_bytes_in_use")


def _meter(memory, backend, target=None):
    if memory not in ("auto", "rss", "allocator", "plan"):
        raise ValueError(f"`memory` must be one of 'auto', 'rss', 'allocator', 'plan'. "
                         f"Received: memory={memory!r}")
    tf_backend = backend in ("tensorflow", "tf_keras")
    if target is not None and (backend != "jax" or memory not in ("auto", "plan")):
        raise ValueError(
            f"`target` plans for a GPU this machine does not have with XLA's plan, on Keras's "
            f"JAX backend (KERAS_BACKEND=jax, memory='plan'): the model runs on Keras's "
            f"{backend} backend with memory={memory!r}. Received: target={target!r}")
    if memory == "plan" and backend != "jax":
        raise ValueError("`memory='plan'` reads XLA's plan of Keras's JAX training step: the "
                         f"model runs on Keras's {backend} backend. Received: memory={memory!r}")
    if memory == "allocator" and not tf_backend:
        raise ValueError("`memory='allocator'` reads TensorFlow's allocator: the model runs "
                         f"on Keras's {backend} backend. Received: memory={memory!r}")
    if memory == "plan" or (memory == "auto" and backend == "jax"):
        return _XlaPlan(target)
    if memory == "allocator" or (memory == "auto" and tf_backend and _tf_gpu()):
        return _TfAllocator("GPU:0" if _tf_gpu() else "CPU:0")
    if memory == "auto" and tf_backend:
        try:  # freed tensors leave the process's RSS high: the allocator where it keeps stats
            return _TfAllocator("CPU:0")
        except RuntimeError:
            pass
    if backend == "jax":
        import jax

        if jax.default_backend() != "cpu":
            raise NotImplementedError(
                "recompute.plan measures JAX's resident memory on the CPU only "
                "(memory='rss'): on a GPU use memory='plan'. Received: JAX's default backend "
                f"{jax.default_backend()!r}")
    return _Rss()


def default_budget_bytes(backend, target=None):
    """The memory of `target` (a card's), JAX's allocator limit on its GPU, TensorFlow's
    memory limit on GPU:0 (what its allocator may take), or None on a CPU."""
    if target is not None:
        from ._xla_plan import TARGETS

        return TARGETS[target]["memory"]
    if backend == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return None
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit")
    if backend in ("tensorflow", "tf_keras") and _tf_gpu():
        from .adapters import _tf

        return _tf.gpu_memory_limit()
    return None


# --------------------------------------------------------------------------
# The record.


@dataclasses.dataclass
class Candidate:
    """One policy's measurements: `points` {batch: (peak bytes, seconds per step)}, the line
    (`intercept`, `slope` bytes), the prediction and the micro-batch that was checked
    (`micro_batch`: measured to fit, the next divisor up measured not to; None: none fits)."""

    policy: object
    points: dict = dataclasses.field(default_factory=dict)
    intercept: float = None
    slope: float = None
    predicted_batch: int = None
    micro_batch: int = None
    refused_batch: int = None
    error: str = None
    baseline: float = None  # bytes alive once the model is built (a previous one not freed shows)
    leftover: float = 0.0  # of those, left by the previous candidates: taken off its peaks
    time_intercept: float = None  # seconds per step ~ time_intercept + time_slope * batch,
    time_slope: float = None  # through the line's two timed steps; once checked, through the
    # micro-batch kept and the divisor refused where both were timed
    estimated_seconds_per_sample: float = None  # that line's, at the predicted micro-batch
    checked: bool = False  # whether the prediction was checked by real steps
    accumulating: set = dataclasses.field(default_factory=set)  # points of accumulating steps

    @property
    def fits(self):
        return self.micro_batch is not None

    def predicted_peak(self, batch):
        return None if self.slope is None else self.intercept + self.slope * batch

    @property
    def measured_peak(self):
        return self.points[self.micro_batch][0] if self.fits else None

    @property
    def seconds_per_sample(self):
        seconds = self.points[self.micro_batch][1] if self.fits else None
        return None if seconds is None else seconds / self.micro_batch

    def estimate(self, batch):
        """Seconds per sample at `batch` from the time line of the two small steps, or None.
        A slope <= 0 (noise) gives the larger small step's time per sample."""
        if self.time_slope is None:
            return None
        if self.time_slope <= 0:
            b = max(b for b, (_, t) in self.points.items() if t is not None)
            return self.points[b][1] / b
        return (self.time_intercept + self.time_slope * batch) / batch

    def as_dict(self):
        return dict(policy=self.policy, micro_batch=self.micro_batch,
                    predicted_batch=self.predicted_batch, refused_batch=self.refused_batch,
                    intercept_mib=None if self.intercept is None else self.intercept / MiB,
                    mib_per_sample=None if self.slope is None else self.slope / MiB,
                    measured_peak_mib=None if not self.fits else self.measured_peak / MiB,
                    seconds_per_sample=self.seconds_per_sample, checked=self.checked,
                    estimated_seconds_per_sample=self.estimated_seconds_per_sample,
                    error=self.error,
                    baseline_mib=None if self.baseline is None else self.baseline / MiB,
                    leftover_mib=self.leftover / MiB,
                    points={str(b): dict(peak_mib=p / MiB, seconds=t)
                            for b, (p, t) in sorted(self.points.items())})


@dataclasses.dataclass
class Plan:
    """What `recompute.plan` chose, and how to train with it.

    `policy` (None: no recomputation), `micro_batch`, `steps_per_update`
    (micro_batch x steps_per_update = `effective_batch`), `predicted_peak` and
    `measured_peak` (bytes, at the micro-batch), `seconds_per_sample` (measured at the
    micro-batch, in `clock`: "CPU s" on a CPU, "s" wall otherwise), `budget` (bytes),
    `memory` (what was measured), `candidates` (a `Candidate` per policy), `seconds` (what
    planning took, wall).
    """

    policy: object
    micro_batch: int
    steps_per_update: int
    effective_batch: int
    predicted_peak: float
    measured_peak: float
    seconds_per_sample: float
    budget: float
    memory: str
    candidates: list
    seconds: float = None
    target: str = None
    clock: str = "s"  # what the seconds per sample are: "CPU s" (a CPU's steps) or "s" (wall)

    @property
    def planned(self):
        """Whether the peaks are XLA's plan (compiled, `memory="plan"`) rather than measured."""
        return self.memory.startswith("XLA's plan")

    # -- applying it

    @property
    def fit_kwargs(self):
        """`dict(batch_size=micro_batch)`, for `model.fit(x, y, **plan.fit_kwargs)`."""
        return dict(batch_size=self.micro_batch)

    def optimizer(self, inner):
        """`AccumOptimizer(inner, steps_per_update)` (`inner` itself when it is 1)."""
        if self.steps_per_update == 1:
            return inner
        from accum import AccumOptimizer

        return AccumOptimizer(inner, steps_per_update=self.steps_per_update)

    def scope(self):
        """`recompute_scope(policy is not None)`: recomputation on for a policy, off for None."""
        return _recompute_scope(self.policy)

    def build(self, build_model):
        """`build_model(policy)` with its compiled optimizer wrapped by `self.optimizer`."""
        model = build_model(self.policy)
        _check_model(model, self.policy, 1)
        _wrap_optimizer(model, self.steps_per_update)
        return model

    def fit(self, model, x=None, y=None, **kwargs):
        """`model.fit(x, y, batch_size=micro_batch, **kwargs)` in `self.scope()`."""
        with self.scope():
            return model.fit(x, y, **self.fit_kwargs, **kwargs)

    # -- reporting it

    def as_dict(self):
        return dict(policy=self.policy, micro_batch=self.micro_batch,
                    steps_per_update=self.steps_per_update, effective_batch=self.effective_batch,
                    budget_gib=self.budget / GiB, memory=self.memory,
                    predicted_peak_gib=self.predicted_peak / GiB,
                    measured_peak_gib=self.measured_peak / GiB,
                    seconds_per_sample=self.seconds_per_sample, plan_seconds=self.seconds,
                    target=self.target, planned=self.planned, clock=self.clock,
                    candidates=[c.as_dict() for c in self.candidates])

    def to_json(self, **kwargs):
        return json.dumps(self.as_dict(), **kwargs)

    def table(self):
        """The candidates as a Markdown table, then the choice."""
        peak = "planned peak GiB" if self.planned else "measured peak GiB"
        lines = [f"Plan for effective batch {self.effective_batch} within "
                 f"{self.budget / GiB:.2f} GiB ({self.memory}):", "",
                 "| policy | MiB at 0 | MiB / sample | predicted | micro-batch | "
                 f"{peak} | next divisor | {self.clock} / sample |",
                 "|---|---|---|---|---|---|---|---|"]
        for c in self.candidates:
            fmt = (lambda v, f: "-" if v is None else format(v, f))
            lines.append(
                f"| {_policy_name(c.policy)} | {fmt(c.intercept and c.intercept / MiB, '.0f')} | "
                f"{fmt(c.slope and c.slope / MiB, '.1f')} | {fmt(c.predicted_batch, 'd')} | "
                f"{fmt(c.micro_batch, 'd') if c.error is None else c.error.split(':')[0]} | "
                f"{fmt(c.measured_peak and c.measured_peak / GiB, '.3f')} | "
                f"{'-' if c.refused_batch is None else f'{c.refused_batch} refused'} | "
                f"{_seconds_cell(c)} |")
        time_text = "no time: nothing ran, the policy that recomputes least was chosen" \
            if self.seconds_per_sample is None else \
            f"{self.seconds_per_sample:.4f} {self.clock}/sample"
        lines += ["", f"Chosen: policy {_policy_name(self.policy)}, micro-batch "
                      f"{self.micro_batch} x {self.steps_per_update} steps per update "
                      f"({peak.replace(' GiB', '')} {self.measured_peak / GiB:.3f} GiB, "
                      f"{time_text})"]
        if self.target is not None:
            lines.append(f"This is a plan: XLA compiled each step for {self.target} here and "
                         "nothing ran; check it on the card before relying on it.")
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def _policy_name(policy):
    return "None" if policy is None else repr(policy)


def _seconds_cell(cand):
    """Measured seconds per sample at the micro-batch kept, or "~" the line's estimate."""
    if cand.seconds_per_sample is not None:
        return f"{cand.seconds_per_sample:.4f}"
    if cand.estimated_seconds_per_sample is not None:
        return f"~{cand.estimated_seconds_per_sample:.4f}"
    return "-"


# --------------------------------------------------------------------------
# Models, data, steps.


def _check_model(model, policy, call):
    if not hasattr(model, "train_on_batch"):
        raise TypeError(f"`build_model({policy!r})` must return a compiled Keras model. "
                        f"Received: {type(model).__name__}")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"`build_model({policy!r})` must return a compiled Keras model (call "
                         "`model.compile(optimizer=..., loss=...)` in it). Received: a model "
                         "with no optimizer")


def _wrap_optimizer(model, steps_per_update):
    """Puts the compiled optimizer (not yet used) into `AccumOptimizer(steps_per_update)`."""
    if steps_per_update == 1:
        return
    from accum import AccumOptimizer

    model.optimizer = AccumOptimizer(model.optimizer, steps_per_update=steps_per_update)
    for attr in ("train_function", "_train_function"):  # a step traced with the old one
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


def _rows(data, n):
    """The first `n` rows of every array of `data` (repeated when it has fewer)."""
    import numpy as np

    def take(a):
        a = np.asarray(a)
        return np.take(a, np.arange(n) % a.shape[0], axis=0)

    if isinstance(data, dict):
        return {k: take(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(take(v) for v in data)
    return take(data)


def _num_rows(data):
    import numpy as np

    first = next(iter(data.values())) if isinstance(data, dict) else (
        data[0] if isinstance(data, (list, tuple)) else data)
    shape = np.shape(first)
    return shape[0] if shape else 0


def _is_oom(error):
    text = f"{type(error).__name__}: {error}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "ResourceExhausted", "OutOfMemory",
                                   "out of memory", "Out of memory")) or \
        isinstance(error, MemoryError)


class _Planner:
    def __init__(self, build_model, x, y, effective_batch, budget, batches, policies, memory,
                 verbose, target=None, every_policy=False):
        self.build_model, self.x, self.y = build_model, x, y
        self.every_policy = every_policy  # no candidate left out on a bound or an estimate
        self.effective_batch, self.budget, self.batches = effective_batch, budget, batches
        self.policies, self.memory, self.verbose = policies, memory, verbose
        self.meter = None
        self.start = time.perf_counter()
        self.clock, self.clock_name = time.perf_counter, "s"  # the steps': `_meter_clock`
        self.target = target
        self.compiled = {}  # (policy, batch): (executable, XLA's plan) (memory="plan")
        self.sizes_seen = {}  # id(model): the batch sizes its train function has seen
        self.leftover = 0.0  # bytes the previous candidates left alive (taken off the peaks)
        self.reference = 0.0  # bytes alive before the first candidate's build
        self.done = []  # the candidates measured so far
        self.previous = None
        self.calls = 0

    def say(self, message):
        if self.verbose:
            elapsed = time.perf_counter() - self.start
            print(f"{PREFIX} {elapsed:4.0f} s  {message}", file=sys.stderr, flush=True)

    def build(self, policy):
        self.calls += 1
        try:
            model = self.build_model(policy)
        except Exception as e:
            if self.calls == 1:
                raise
            raise ValueError(
                f"`build_model({policy!r})` failed on call {self.calls}: the planner builds a "
                f"fresh model for every candidate policy, so `build_model` must be callable "
                f"more than once. Received: {type(e).__name__}: {e}") from e
        if self.previous is not None and model is self.previous():
            raise ValueError("`build_model` must build a new model at every call (the planner "
                             "builds one per candidate policy). Received: the same model "
                             "object twice")
        _check_model(model, policy, self.calls)
        import weakref

        self.previous = weakref.ref(model)
        return model

    def step(self, model, policy, batch, timed=False, update=True):
        """(peak bytes, seconds or None) of a training step at `batch` (its peak after a
        reset), or (None, None) when it ran out of memory.

        The optimizer is wrapped in `AccumOptimizer(k=2)`: a step either accumulates or
        updates (the inner optimizer's update and its temporaries on top of the backward
        pass's peak). `update`: True, the step measured updates (an accumulating step is
        run first, unmeasured, where the next one would not): what the check measures, so
        that the micro-batch kept was measured at its highest; False, it accumulates: what
        the line measures (the update's peak does not grow with the batch and would flatten
        it at small micro-batches). The seconds are the step's own unless it traced
        (`_Planner.run_step`); with `timed`, a step that traced is run again, timed."""
        x, y = _rows(self.x, batch), _rows(self.y, batch)
        if self.meter.name == "plan":
            return self.plan_step(model, policy, batch, x, y, timed)
        try:
            with _recompute_scope(policy):
                self.to_step(model, update)
                self.meter.reset()
                seconds = self.run_step(model, x, y, batch)
                if timed and seconds is None:
                    seconds = self.run_step(model, x, y, batch)
        except Exception as e:
            return self.out_of_memory(e, policy, batch)
        return self.meter.peak() - self.leftover, seconds

    def run_step(self, model, x, y, batch):
        """One training step on (x, y); its seconds, or None when it traced or compiled.

        On TensorFlow (Keras 3's and tf_keras), as `fit` runs it: the model's train function
        on an iterator of a dataset whose batch dimension is unknown, so that one trace
        serves every micro-batch (`train_on_batch` traces at a model's first two batch
        sizes). On JAX, `train_on_batch`, which compiles at each new batch size."""
        sizes = self.sizes_seen.setdefault(id(model), set())
        family = _backend_of(model)
        traces = not sizes if family in ("tensorflow", "tf_keras") else batch not in sizes
        sizes.add(batch)
        t0 = self.clock()
        if family in ("tensorflow", "tf_keras"):
            import tensorflow as tf

            inputs = tuple(x) if isinstance(x, list) else x  # a list would be one tensor
            iterator = iter(tf.data.Dataset.from_tensor_slices((inputs, y)).batch(batch))
            if family == "tf_keras":
                model.train_function = model.make_train_function()
                with model.distribute_strategy.scope():
                    model.train_function(iterator)
            else:
                model.make_train_function()
                model.train_function(iterator)
        else:
            model.train_on_batch(x, y)
        return None if traces else self.clock() - t0

    def to_step(self, model, update):
        """Runs one step, unmeasured, if the next step would not be an update (`update`
        True: the micro-steps of `AccumOptimizer(k=2)` so far are even) or would be one
        (`update` False: they are odd), at `small_batch`."""
        counter = getattr(model.optimizer, "micro_steps", None)
        if counter is None:
            return
        import numpy as np

        if (int(np.asarray(counter)) % 2 == 1) != update:
            batch = self.small_batch(model)
            self.run_step(model, _rows(self.x, batch), _rows(self.y, batch), batch)

    def small_batch(self, model):
        """The micro-batch of the unmeasured steps: 1 on TensorFlow (one trace serves every
        size), else the line's smaller one (compiled by the first step)."""
        return 1 if _backend_of(model) in ("tensorflow", "tf_keras") else self.batches[0]

    def out_of_memory(self, error, policy, batch):
        """(None, None) for a step that ran out of memory, said; any other error raised."""
        if not _is_oom(error):
            raise error
        self.say(f"policy {_policy_name(policy)}, micro-batch {batch}: out of memory")
        return None, None

    def plan_step(self, model, policy, batch, x, y, timed):
        """(planned peak bytes, None) of the step compiled at `batch`; with `timed` (the local
        device only), the compiled step also runs twice: (planned, seconds of the second)."""
        from . import _xla_plan

        if (policy, batch) not in self.compiled:
            with _recompute_scope(policy):
                self.compiled[policy, batch] = _xla_plan.train_step_plan(
                    model, x, y, self.meter.sharding)
        compiled, planned = self.compiled[policy, batch]
        if not timed or self.meter.target is not None:
            return planned["peak"], None
        try:
            _xla_plan.run_step(model, compiled, x, y)  # the first run (allocations, caches)
            t0 = self.clock()
            _xla_plan.run_step(model, compiled, x, y)
            seconds = self.clock() - t0
        except Exception as e:
            return self.out_of_memory(e, policy, batch)
        planned["allocator_peak"] = self.meter.allocator_peak()
        return planned["peak"], seconds

    def time(self, cand, model):
        """Times the candidate's micro-batch where its measured step has no time (it traced,
        or it was compiled only): more steps, whose peak joins the one measured; out of
        memory there, the candidate does not fit."""
        if not cand.fits or (self.meter.name == "plan" and self.meter.target is not None):
            return
        batch = cand.micro_batch
        if cand.points[batch][1] is not None:
            return
        peak, seconds = self.step(model, cand.policy, batch, timed=True)
        if peak is None:
            cand.error = f"out of memory when timed at micro-batch {batch}"
            cand.refused_batch, cand.micro_batch = batch, None
            return
        cand.points[batch] = (max(peak, cand.points[batch][0]), seconds)
        self.say(f"policy {_policy_name(cand.policy)}, micro-batch {batch}: "
                 f"{seconds / batch:.4f} {self.clock_name}/sample")

    def retime(self, cand):
        """The time line through the micro-batch kept and the divisor refused when both
        steps were timed (updating steps, larger and steadier than the line's): what
        `bounded` reads of `cand` from then on."""
        if not cand.fits or cand.refused_batch is None:
            return
        kept, refused = cand.points[cand.micro_batch], cand.points.get(cand.refused_batch)
        if kept[1] is None or refused is None or refused[1] is None:
            return
        cand.time_intercept, cand.time_slope = fit_line(
            [(cand.micro_batch, kept[1]), (cand.refused_batch, refused[1])])
        self.say(f"policy {_policy_name(cand.policy)}: seconds per step ~ "
                 f"{cand.time_intercept:.3f} + {cand.time_slope:.4f} x batch "
                 f"({self.clock_name}, micro-batches {cand.micro_batch} and "
                 f"{cand.refused_batch})")

    def measure(self, cand, model, batch, timed=False, update=True):
        """Whether a step at `batch` fits, measured once (`step`); a step that accumulated
        and fit is measured again when an update is asked for (an update holds more)."""
        known = cand.points.get(batch)
        if known is not None and update and batch in cand.accumulating and \
                known[0] <= self.budget:
            del cand.points[batch]
            cand.accumulating.discard(batch)
        if batch not in cand.points:
            plan = getattr(self.meter, "name", None) == "plan"
            if not update and not plan:
                cand.accumulating.add(batch)
            peak, seconds = self.step(model, cand.policy, batch, timed, update) \
                if timed or not update else self.step(model, cand.policy, batch)
            cand.points[batch] = (float("inf") if peak is None else peak, seconds)
            if peak is not None:
                time_text = "" if seconds is None else f", {seconds / batch:.4f} {self.clock_name}/sample"
                kind = "" if plan else " (updating)" if update else " (accumulating)"
                self.say(f"policy {_policy_name(cand.policy)}, micro-batch {batch}{kind}: "
                         f"{'planned' if plan else 'peak'} "
                         f"{peak / GiB:.3f} GiB{time_text} "
                         f"({'fits' if peak <= self.budget else 'over the budget'})")
        return cand.points[batch][0] <= self.budget

    def line(self, cand, model):
        """The two small steps of the line, accumulating, each timed. On a meter that runs
        steps, a first step at `small_batch` and an update before them, unmeasured: the
        first traces the train function; optimizers build their state (Adam's moments)
        at their first update."""
        b1, b2 = self.batches
        if self.meter.name != "plan":
            t0 = time.perf_counter()
            batch = self.small_batch(model)
            try:
                with _recompute_scope(cand.policy):
                    self.run_step(model, _rows(self.x, batch), _rows(self.y, batch), batch)
                    self.to_step(model, update=False)
            except Exception as e:
                self.out_of_memory(e, cand.policy, batch)
                cand.points[b1] = (float("inf"), None)
                return
            self.say(f"policy {_policy_name(cand.policy)}: first steps (micro-batch {batch}, "
                     f"trace the train function, unmeasured) {time.perf_counter() - t0:.1f} s")
        for b in (b2, b1):
            self.measure(cand, model, b, timed=True, update=False)

    def candidate(self, policy, first):
        cand = Candidate(policy)
        reason = self.bounded(policy)
        if reason is not None:
            return self.left_out(cand, reason)
        model = self.built(cand, first)
        # The accumulation buffers are part of the peak; their size does not depend on k.
        _wrap_optimizer(model, 2)
        dominant = self.dominant(cand)
        try:
            if dominant is not None and dominant.micro_batch >= self.effective_batch:
                return self.left_out(cand, f"no larger: policy {_policy_name(dominant.policy)}, "
                                           "which recomputes less, fits the effective batch",
                                     "not measured, ")
            if not self.predicted(cand, model, dominant):
                return cand
            if dominant is not None:  # at or below its micro-batch, this one is no faster
                self.say(f"policy {_policy_name(policy)}: checked above micro-batch "
                         f"{dominant.micro_batch}, which policy "
                         f"{_policy_name(dominant.policy)} fits recomputing less")
            cand.checked = True
            self.check(cand, model, floor=dominant.micro_batch if dominant else None)
            if dominant is not None and not cand.fits:
                return self.left_out(cand, f"no larger: policy {_policy_name(dominant.policy)}, "
                                           f"which recomputes less, fits micro-batch "
                                           f"{dominant.micro_batch}; this one does not fit "
                                           f"{cand.refused_batch}")
            self.time(cand, model)
            self.retime(cand)
        finally:
            self.compiled.clear()
            self.sizes_seen.clear()
            family = _backend_of(model)
            del model
            _clear_session(family)
        return cand

    def left_out(self, cand, reason, how=""):
        """`cand`, left out for `reason` (said, after `how`)."""
        cand.error = reason
        self.say(f"policy {_policy_name(cand.policy)}: {how}{reason}")
        return cand

    def built(self, cand, first):
        """`cand`'s model, built, with what the process held before it measured (the first
        candidate refuses a budget below the model's weights)."""
        policy = cand.policy
        before = None
        if self.meter is not None and self.meter.name != "plan":
            self.meter.reset()
            before = self.meter.current()  # the previous candidates' leftovers, if any
        t0 = time.perf_counter()
        model = self.build(policy)
        self.say(f"policy {_policy_name(policy)}: model built in "
                 f"{time.perf_counter() - t0:.1f} s")
        if self.meter is None:
            self.meter = _meter(self.memory, _backend_of(model), self.target)
        self.clock, self.clock_name = _meter_clock(self.meter)
        self.meter.reset()
        self.leftover = 0.0
        if self.meter.name != "plan":  # a compilation allocates nothing: no baseline
            cand.baseline = self.meter.current()
            if before is None:  # the first: what the process held before its build
                self.reference = cand.baseline - sum(int(_size(v)) for v in model.weights)
            else:
                self.leftover = cand.leftover = max(0.0, before - self.reference)
            self.say(f"policy {_policy_name(policy)}: {cand.baseline / GiB:.3f} GiB alive "
                     f"after the build ({self.meter.what.replace(' peak', '')}), of which "
                     f"{self.leftover / GiB:.3f} GiB left by the previous candidates "
                     "(not counted)")
        if first:
            weights = sum(int(_size(v)) for v in model.weights)
            if weights > self.budget:
                raise ValueError(
                    f"`budget_gib` must be above the model's weights alone "
                    f"({weights / GiB:.3f} GiB): no micro-batch can train within it. "
                    f"Received: budget_gib={self.budget / GiB:g}")
        return model

    def predicted(self, cand, model, dominant):
        """Measures `cand`'s line and predicts its micro-batch; False (its `error` set) when
        it cannot be measured or cannot win."""
        policy = cand.policy
        self.line(cand, model)
        (b1, (p1, t1)), (b2, (p2, t2)) = sorted(cand.points.items())[:2] \
            if len(cand.points) >= 2 else ((None, (float("inf"), None)),) * 2
        if p1 == float("inf") or p2 == float("inf"):
            cand.error = "out of memory at a measured micro-batch"
            return False
        cand.intercept, cand.slope = fit_line([(b1, p1), (b2, p2)])
        cand.predicted_batch = predict(cand.intercept, cand.slope, self.effective_batch,
                                       self.budget)
        if t1 is not None and t2 is not None:
            cand.time_intercept, cand.time_slope = fit_line([(b1, t1), (b2, t2)])
        divs = divisors(self.effective_batch)
        above = [d for d in divs if dominant is None or d > dominant.micro_batch]
        target = max(cand.predicted_batch or 1, above[0])
        cand.estimated_seconds_per_sample = cand.estimate(target)
        estimate = "" if cand.estimated_seconds_per_sample is None else \
            f", ~{cand.estimated_seconds_per_sample:.4f} {self.clock_name}/sample there"
        self.say(f"policy {_policy_name(policy)}: peak ~ {cand.intercept / MiB:.0f} MiB + "
                 f"{cand.slope / MiB:.2f} MiB x batch; predicted micro-batch "
                 f"{cand.predicted_batch}{estimate}")
        reason = self.cannot_win(cand, target)
        if reason is not None:
            self.left_out(cand, reason)
            return False
        return True

    def bounded(self, policy):
        """Why `policy` is not even built, or None: a candidate checked before that
        recomputes less, L, bounds it. At a micro-batch b above L's, `policy` does at least
        L's work per sample, and L's time per sample there is at least its measured one at
        its micro-batch b_L less what its time line's intercept c (`retime`'s, through b_L
        and the divisor refused, where both were timed) would spread over more samples: S_L - c * (1 / b_L - 1 / b), the least at the effective batch (c <= 0:
        nothing to spread). When the fastest time per sample measured is within
        `SKIP_MARGIN` of that bound, `policy` cannot win by more."""
        fastest = self.fastest()
        if fastest is None or self.every_policy:
            return None
        for light in self.done:
            if not light.fits or light.time_intercept is None or \
                    light.seconds_per_sample is None or \
                    _recompute_rank(light.policy) >= _recompute_rank(policy):
                continue
            if light.micro_batch >= self.effective_batch:
                continue  # nothing above: `candidate` says "no larger"
            bound = light.seconds_per_sample - max(light.time_intercept, 0.0) * (
                1.0 / light.micro_batch - 1.0 / self.effective_batch)
            if fastest.seconds_per_sample <= SKIP_MARGIN * bound:
                return (f"not measured: above micro-batch {light.micro_batch}, policy "
                        f"{_policy_name(light.policy)}'s time per sample stays above "
                        f"{bound:.4f} {self.clock_name} (measured {light.seconds_per_sample:.4f}"
                        f", less its time line's intercept spread over more samples), so a "
                        f"policy that recomputes more cannot beat the fastest measured, policy "
                        f"{_policy_name(fastest.policy)}'s {fastest.seconds_per_sample:.4f}, "
                        f"by more than {SKIP_MARGIN:g} x")
        return None

    def cannot_win(self, cand, batch):
        """Why `cand` is not checked -- its estimate at `batch` is over `SKIP_MARGIN` times
        the time per sample measured for a candidate checked before --, or None."""
        fastest = self.fastest()
        estimate = cand.estimated_seconds_per_sample
        if fastest is None or estimate is None or self.every_policy or \
                estimate < SKIP_MARGIN * fastest.seconds_per_sample:
            return None
        return (f"not checked: its estimate at micro-batch {batch}, {estimate:.4f} "
                f"{self.clock_name}/sample, is over {SKIP_MARGIN:g} x policy "
                f"{_policy_name(fastest.policy)}'s measured {fastest.seconds_per_sample:.4f} "
                f"at {fastest.micro_batch}")

    def fastest(self):
        """The candidate checked so far with the least measured time per sample, or None."""
        timed = [c for c in self.done if c.fits and c.seconds_per_sample is not None]
        return min(timed, key=lambda c: c.seconds_per_sample) if timed else None

    def check(self, cand, model, floor=None):
        """Measures the predicted divisor, then steps up while the largest divisor measured
        to fit has nothing refused above it, and, once one is refused, narrows the bracket
        between the largest divisor measured to fit and the smallest measured not to by
        interpolating their peaks (the line can be far off: XLA's plan of a small batch can
        be held up by buffers the size of the weights) until they are neighbours. The
        points measured for the line count.

        `floor`: a micro-batch a policy that recomputes less fits: the divisors up to it
        are taken as fitting, unmeasured (`cand` would not be faster there); if the one
        above it does not fit, `cand` keeps no micro-batch."""
        divs = divisors(self.effective_batch)

        floor_index = divs.index(floor) if floor in divs else -1

        def bracket():
            fit, refused = floor_index, len(divs)  # indices: largest known to fit, smallest not
            for b, (peak, _) in cand.points.items():
                if b in divs:
                    if peak <= self.budget and b in cand.accumulating:
                        continue  # an accumulating step fit: the update is not measured
                    if peak <= self.budget:
                        fit = max(fit, divs.index(b))
                    else:
                        refused = min(refused, divs.index(b))
            return fit, refused

        fit, refused = bracket()
        i = divs.index(cand.predicted_batch) if cand.predicted_batch else 0
        while refused - fit > 1:
            if not fit < i < refused:
                i = self._between(cand, divs, fit, refused)
            self.measure(cand, model, divs[i])
            fit, refused = bracket()
            i = -1
        cand.refused_batch = divs[refused] if refused < len(divs) else None
        measured = fit >= 0 and cand.points.get(divs[fit], (float("inf"),))[0] <= self.budget
        cand.micro_batch = divs[fit] if measured else None

    def _between(self, cand, divs, fit, refused):
        """The next divisor to measure strictly between the indices `fit` and `refused`:
        the one above `fit` while nothing is refused; else where the line through the
        peaks of the largest divisor measured under the budget (an accumulating step's
        counts here, not as a verdict) and the smallest measured over it crosses the budget
        (the largest divisor below the crossing)."""
        if refused == len(divs):
            return fit + 1
        under = [divs.index(b) for b, (peak, _) in cand.points.items()
                 if b in divs and peak <= self.budget and divs.index(b) < refused]
        low = max(under + [fit])
        if low < 0 or divs[low] not in cand.points:
            return fit + 1 if fit >= 0 else (fit + refused) // 2
        (b0, p0), (b1, p1) = [(divs[j], cand.points[divs[j]][0]) for j in (low, refused)]
        if p1 == float("inf"):
            return (fit + refused) // 2
        crossing = b0 + (self.budget - p0) * (b1 - b0) / max(p1 - p0, 1e-9)
        below = [j for j in range(fit + 1, refused) if divs[j] <= crossing]
        return below[-1] if below else fit + 1

    def dominant(self, cand):
        """The candidate already checked with the largest micro-batch among those that
        recompute less than `cand` (at that micro-batch or below, `cand` cannot be faster
        per sample), or None."""
        rank = _recompute_rank(cand.policy)
        less = [c for c in self.done if c.fits and _recompute_rank(c.policy) < rank]
        return max(less, key=lambda c: c.micro_batch) if less else None

    def run(self):
        start = time.perf_counter()
        candidates = self.done = []
        for n, policy in enumerate(self.policies):
            candidates.append(self.candidate(policy, first=n == 0))
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            raise ValueError(
                f"No micro-batch of effective_batch={self.effective_batch} trains within "
                f"budget_gib={self.budget / GiB:g} under any policy "
                f"({', '.join(_policy_name(c.policy) for c in candidates)}); the smallest "
                f"measured peaks: " + ", ".join(
                    f"{_policy_name(c.policy)} {min(p for p, _ in c.points.values()) / GiB:.3f} "
                    f"GiB" for c in candidates if c.points))
        if any(c.seconds_per_sample is None for c in fitting):  # a target's plan: no time
            best = min(fitting, key=lambda c: (_recompute_rank(c.policy), -c.micro_batch))
        else:
            best = min(fitting, key=lambda c: (c.seconds_per_sample, c.measured_peak))
        plan = Plan(policy=best.policy, micro_batch=best.micro_batch,
                    steps_per_update=self.effective_batch // best.micro_batch,
                    effective_batch=self.effective_batch,
                    predicted_peak=best.predicted_peak(best.micro_batch),
                    measured_peak=best.measured_peak, seconds_per_sample=best.seconds_per_sample,
                    budget=self.budget, memory=self.meter.what, candidates=candidates,
                    seconds=time.perf_counter() - start, target=self.target,
                    clock=self.clock_name)
        self.say(f"chosen: policy {_policy_name(plan.policy)}, micro-batch {plan.micro_batch} "
                 f"x {plan.steps_per_update} ({plan.seconds:.0f} s)")
        return plan


def _meter_clock(meter):
    """(clock, its name) of the steps' time: the process's CPU seconds (all threads) where
    the steps run on a CPU -- on a shared machine they count the work done, not the waits
    for a core --, else wall seconds."""
    cpu = isinstance(meter, _Rss) or getattr(meter, "device", None) == "CPU:0"
    if isinstance(meter, _XlaPlan) and meter.target is None:
        import jax

        cpu = jax.default_backend() == "cpu"
    return (time.process_time, "CPU s") if cpu else (time.perf_counter, "s")


def _recompute_scope(policy):
    from ._config import recompute_scope

    return recompute_scope(policy is not None)


def _recompute_rank(policy):
    """How much a policy recomputes: None nothing, "attention" the attention core, others
    (a block, "full") more."""
    return {None: 0, "attention": 1}.get(policy, 2)


def _clear_session(family):
    """Drops Keras's global state of the family (`clear_session`), then collects."""
    if family == "tf_keras":
        import tf_keras

        tf_keras.backend.clear_session()
    else:
        import keras

        keras.backend.clear_session()
    gc.collect()


def _size(variable):
    import numpy as np

    shape = tuple(int(d) for d in variable.shape)
    dtype = getattr(variable, "dtype", "float32")
    dtype = getattr(dtype, "name", dtype)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = 4
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def plan(build_model, x, y, effective_batch, budget_gib=None, *, policies=DEFAULT_POLICIES,
         batches=DEFAULT_BATCHES, memory="auto", target=None, every_policy=False,
         verbose=True):
    """Measures which policy, micro-batch and accumulation steps train `effective_batch` fastest
    within a memory budget (the module docstring says how, docs/plan.md when to trust it).

    ```python
    def build_model(policy):                 # None: no recomputation
        model = make_model(policy)           # e.g. blocks with recompute_grad(policy=policy)
        model.compile(optimizer="adam", loss="mse")
        return model

    plan = recompute.plan(build_model, x[:8], y[:8], effective_batch=64, budget_gib=4)
    model = plan.build(build_model)          # build_model(plan.policy), AccumOptimizer(k)
    plan.fit(model, x, y, epochs=3)          # batch_size=plan.micro_batch, recompute_scope
    ```

    Args:
        build_model: `build_model(policy)` builds and compiles a new model for `policy` (one
            of `policies`; None: no recomputation). It is called once per policy, then once
            by `Plan.build`.
        x, y: a sample batch (arrays, or a dict/list of arrays); its rows are repeated to
            make each micro-batch measured.
        effective_batch: the batch one update should see: micro_batch x steps_per_update.
        budget_gib: the memory budget in GiB. Default: the GPU's (TensorFlow's memory limit
            on it, JAX's allocator limit, or the `target` card's memory); required on a CPU.
        policies: the candidates (default None, "attention", "full"; a bert4keras builder
            maps "full" to "block").
        batches: the two micro-batches the line is measured at (default 2, 4), on
            accumulating steps, each timed.
        memory: "auto", "allocator", "rss" or "plan" (the module docstring says which is
            which; "auto" is "plan" on Keras's JAX backend).
        target: on Keras's JAX backend, a GPU to plan for that this machine need not have:
            "h100", "a100-40", "l4" or "rtx4090". Every step is compiled by XLA for it and
            read from `memory_analysis()`, nothing runs: the result is a plan
            (`Plan.planned`), and with no time measured the policy that recomputes least
            among those that fit is chosen. Needs JAX's CUDA plugin and JAX started with
            JAX_PLATFORMS=cpu,cuda (set here if JAX has not started).
        every_policy: True: every candidate is built, measured and checked; none is left
            out on the bound of a lighter policy or on its time line's estimate (item 3 of
            the module docstring). Slower: bert4keras BERT-base at seq 256, an estimated
            250 s against 152 s measured without it on 2 CPU cores (docs/plan.md). The
            default leaves them out.
        verbose: progress lines on stderr ("[recompute.plan] ...").

    Returns:
        A `Plan`.

    Limits: each candidate costs a build, one trace of its train function (on TensorFlow),
    two small steps for its line and two unmeasured ones; a candidate checked adds real
    steps at its micro-batch and at the next divisor up, which dominate for large models
    (seconds per sample x (b + the next divisor)). A candidate not checked was left out on
    its time line's estimate (`Candidate.estimated_seconds_per_sample`), not a measurement.

    Raises:
        ValueError: bad arguments, a budget below the weights, a `build_model` that cannot
            build twice, no micro-batch that fits under any policy, or a `target` off Keras's
            JAX backend.
        RuntimeError: a `target` JAX cannot compile for here (no CUDA plugin, or JAX started
            without the CUDA platform).
    """
    effective_batch = _check_effective_batch(effective_batch)
    batches = _check_batches(batches, effective_batch)
    budget = _check_budget(budget_gib)
    policies = tuple(policies)
    if not isinstance(every_policy, bool):
        raise TypeError(f"`every_policy` must be True or False. "
                        f"Received: every_policy={every_policy!r}")
    if not policies:
        raise ValueError(f"`policies` must name at least one policy. Received: policies={policies}")
    if not callable(build_model):
        raise TypeError(f"`build_model` must be a callable build_model(policy). "
                        f"Received: {build_model!r}")
    if _num_rows(x) < 1:
        raise ValueError("`x` must be a sample batch with at least one row. "
                         f"Received: x of shape {getattr(x, 'shape', None)}")
    meter = None
    if target is not None:
        from . import _xla_plan

        _xla_plan.check_target(target)
        meter = _meter(memory, _backend_guess(), target)  # the backend, the plugin: now
    if budget is None:
        backend = _backend_guess()
        default = default_budget_bytes(backend, target)
        if default is None:
            raise ValueError(
                "`budget_gib` is required on a CPU (the default is the accelerator's memory, "
                "and there is none). Received: budget_gib=None")
        budget_bytes = float(default)
    else:
        budget_bytes = budget * GiB
    planner = _Planner(build_model, x, y, effective_batch, budget_bytes, batches, policies,
                       memory, verbose, target, every_policy)
    planner.meter = meter
    return planner.run()


def _backend_guess():
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1" and "keras" not in sys.modules:
        return "tf_keras"
    import keras

    return keras.backend.backend()


# --------------------------------------------------------------------------
# The command: python -m recompute.planner --preset PATH --seq 512 --effective-batch 256


def _bert4keras_builder(folder, seq, learning_rate):
    """build_model(policy) of a bert4keras checkpoint folder (bert_config.json, bert_model.ckpt)
    plus CLS -> Dense(2): "full" is `patch(policy="block")`, None `patch()` with recomputation
    off."""
    import recompute.bert4keras

    if folder == "bert-base":  # BERT-base's shape, random weights: a config, no checkpoint
        import tempfile

        config_path = os.path.join(tempfile.mkdtemp(prefix="recompute_plan_"),
                                   "bert_config.json")
        with open(config_path, "w") as f:
            json.dump(dict(vocab_size=BERT_BASE["vocabulary_size"], hidden_size=768,
                           num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, hidden_act="gelu",
                           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                           max_position_embeddings=max(seq, 512), type_vocab_size=2), f)
        checkpoint = None
    else:
        config_path = os.path.join(folder, "bert_config.json")
        checkpoint = os.path.join(folder, "bert_model.ckpt")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("max_position_embeddings", 512) < seq:
        raise ValueError(f"--seq {seq} exceeds the checkpoint's max_position_embeddings "
                         f"{config['max_position_embeddings']}")

    def build_model(policy):
        recompute.bert4keras.patch(policy={None: "layer", "full": "block"}.get(policy, policy))
        import tf_keras
        from bert4keras.models import build_transformer_model

        tf_keras.utils.set_random_seed(0)
        bert = build_transformer_model(config_path, checkpoint)
        cls = tf_keras.layers.Lambda(lambda x: x[:, 0], name="CLS")(bert.output)
        model = tf_keras.Model(bert.inputs, tf_keras.layers.Dense(2, name="classifier")(cls))
        model.compile(optimizer=tf_keras.optimizers.Adam(learning_rate),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    vocab = config["vocab_size"]
    return build_model, lambda ids: [ids, np.zeros_like(ids)], vocab


BERT_BASE = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
                 intermediate_dim=3072, dropout=0.1)


def _keras_hub_builder(folder, seq, learning_rate):
    """build_model(policy) of a keras-hub preset's backbone plus first token -> Dense(2):
    `recompute.keras_hub.patch(policy)`, or `unpatch()` for None. `folder` "bert-base":
    keras-hub's `BertBackbone` at BERT-base's shape (`BERT_BASE`), randomly initialized (no
    download: for planning, whose memory does not depend on the weights' values)."""
    import keras
    import keras_hub

    import recompute.keras_hub

    def build_model(policy):
        if policy is None:
            recompute.keras_hub.unpatch()
        else:
            recompute.keras_hub.patch(policy=policy)
        keras.utils.set_random_seed(0)
        if folder == "bert-base":
            backbone = keras_hub.models.BertBackbone(**BERT_BASE,
                                                     max_sequence_length=max(seq, 512))
        else:
            backbone = keras_hub.models.Backbone.from_preset(folder)
        inputs = {name: keras.Input((seq,), dtype="int32", name=name)
                  for name in backbone.input}
        outputs = backbone(inputs)
        first = outputs["pooled_output"] if "pooled_output" in outputs else \
            outputs["sequence_output"][:, 0]
        model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(first))
        model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if folder == "bert-base":
        vocab = BERT_BASE["vocabulary_size"]
    else:
        with open(os.path.join(folder, "config.json")) as f:
            vocab = json.load(f).get("config", {}).get("vocabulary_size", 30522)

    def inputs(ids):
        return {"token_ids": ids, "segment_ids": np.zeros_like(ids),
                "padding_mask": (ids != 0).astype("int32")}

    return build_model, inputs, vocab


np = None  # numpy, imported by `main` (the library's import stays light)


def _sample(seq, vocab, rows=4, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(min(1000, vocab // 2), vocab, size=(rows, seq)).astype("int32")
    ids[:, 0] = 101 if vocab > 101 else 1
    return ids, rng.randint(0, 2, size=(rows,)).astype("int32")


def _preset_folder(preset):
    """The folder of `--preset`: a path, `minilm` (the converted MiniLM: keras-hub's preset,
    or bert4keras's checkpoint under TF_USE_LEGACY_KERAS=1), or `bert-base` (itself: keras-hub's
    BertBackbone at BERT-base's shape, random weights)."""
    if preset == "bert-base":
        return preset
    if preset != "minilm":
        return os.path.abspath(os.path.expanduser(preset))
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        from .bert4keras import converter

        return os.path.dirname(converter.minilm().config_path)
    from .keras_hub import minilm_preset

    return minilm_preset()


def _policy_arg(text):
    import argparse

    names = [t.strip() for t in text.split(",") if t.strip()]
    known = ("none", "attention", "full")
    if not names or any(n not in known for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct names from {','.join(known)}, got {text!r}")
    return tuple(None if n == "none" else n for n in names)


def _int_pair(text):
    import argparse

    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 1 or values[0] == values[1]:
        raise argparse.ArgumentTypeError(f"expected two different positive integers such as "
                                         f"2,4, got {text!r}")
    return values


def _parser():
    """The command's arguments."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m recompute.planner",
        description="The recomputation policy, micro-batch and accumulation steps that train "
                    "an effective batch fastest within a memory budget, measured (recompute.plan).")
    parser.add_argument("--preset", required=True,
                        help="a keras-hub preset folder, a bert4keras checkpoint folder "
                             "(bert_config.json, bert_model.ckpt), or 'minilm'")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    parser.add_argument("--effective-batch", type=int, required=True)
    parser.add_argument("--budget-gib", type=float,
                        help="memory budget in GiB (required on a CPU; default: the GPU's)")
    parser.add_argument("--policies", type=_policy_arg, default=DEFAULT_POLICIES,
                        help="comma-separated from none,attention,full (default all three)")
    parser.add_argument("--batches", type=_int_pair, default=DEFAULT_BATCHES,
                        help="the two micro-batches of the line (default 2,4)")
    parser.add_argument("--memory", choices=("auto", "rss", "allocator", "plan"), default="auto")
    parser.add_argument("--target", choices=sorted(_TARGET_NAMES),
                        help="on JAX: plan for this GPU with XLA's plan, compiled here, nothing "
                             "run (a plan, not a measurement; sets JAX_PLATFORMS=cpu,cuda)")
    parser.add_argument("--every-policy", action="store_true",
                        help="build, measure and check every policy (none left out on a "
                             "lighter policy's bound or on its time line's estimate)")
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")
    return parser


def _builder(parser, args):
    """(build_model, make_inputs, vocabulary, what it is, folder) of `--preset`."""
    folder = _preset_folder(args.preset)
    if folder == "bert-base" and os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        build_model, make_inputs, vocab = _bert4keras_builder(folder, args.seq, args.learning_rate)
        kind = "bert4keras BERT at BERT-base's shape (random weights)"
    elif folder == "bert-base":
        build_model, make_inputs, vocab = _keras_hub_builder(folder, args.seq, args.learning_rate)
        kind = "keras-hub BertBackbone at BERT-base's shape (random weights)"
    elif os.path.isfile(os.path.join(folder, "bert_config.json")):
        if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
            parser.error("a bert4keras checkpoint needs TF_KERAS=1 TF_USE_LEGACY_KERAS=1 in the "
                         "environment: TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m "
                         "recompute.planner ...")
        build_model, make_inputs, vocab = _bert4keras_builder(folder, args.seq, args.learning_rate)
        kind = "bert4keras checkpoint"
    elif os.path.isfile(os.path.join(folder, "config.json")):
        build_model, make_inputs, vocab = _keras_hub_builder(folder, args.seq, args.learning_rate)
        kind = "keras-hub preset"
    else:
        parser.error(f"--preset: expected a folder with config.json (keras-hub) or "
                     f"bert_config.json (bert4keras), got {args.preset!r}")
    return build_model, make_inputs, vocab, kind, folder


def main(argv=None):
    """`python -m recompute.planner --preset PATH --seq N --effective-batch N [--budget-gib G]
    [--target h100|a100-40|l4|rtx4090]`.

    Plans a keras-hub preset (a folder with config.json) or a bert4keras checkpoint (a
    folder with bert_config.json; run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1) with a 2-way
    classification head, on random token ids. Prints progress on stderr, the table on
    stdout, and the record as JSON with `--json PATH`. Returns the exit code."""
    global np
    import numpy

    np = numpy
    parser = _parser()
    args = parser.parse_args(argv)
    if args.target is not None:
        import keras

        if keras.backend.backend() != "jax":
            parser.error(f"--target plans with XLA on Keras's JAX backend; Keras runs on "
                         f"{keras.backend.backend()!r} here (KERAS_BACKEND="
                         f"{os.environ.get('KERAS_BACKEND')!r}): unset KERAS_BACKEND or set it "
                         "to jax")
    build_model, make_inputs, vocab, kind, folder = _builder(parser, args)
    ids, labels = _sample(args.seq, vocab)
    print(f"{PREFIX} {kind} {folder}, seq {args.seq}", file=sys.stderr, flush=True)
    try:
        result = plan(build_model, make_inputs(ids), labels, args.effective_batch,
                      args.budget_gib, policies=args.policies, batches=args.batches,
                      memory=args.memory, target=args.target,
                      every_policy=args.every_policy)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json(indent=1))
    return 0


_TARGET_NAMES = ("a100-40", "h100", "l4", "rtx4090")  # recompute._xla_plan.TARGETS' names


if __name__ == "__main__":
    if any(a == "--target" or a.startswith("--target=") for a in sys.argv[1:]):
        from recompute import _xla_plan  # the package's imports started Keras: run again

        _xla_plan.rerun_with_environment("recompute.planner", sys.argv[1:])
    sys.exit(main())
