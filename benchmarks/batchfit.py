"""What batch fits? The largest micro-batch that trains a bert4keras BERT within a memory budget.

    python -m benchmarks.batchfit --quick
    python -m benchmarks.batchfit --models base,large --seq-len 512 --budget-gib 8
    python -m benchmarks.batchfit --models minilm --seq-len 256 --budget-gib 4 \\
        --accum-steps 8 --json out.json --plot out.png

For each model shape (`base`: 12 layers, hidden 768, 12 heads, FFN 3072;
`large`: 24, 1024, 16, 4096; `minilm`: the real MiniLM, 6, 384, 12, 1536,
with its converted weights from `recompute.bert4keras.converter.minilm()`; `tiny`: 2,
64, 8, 256 for smoke tests; vocabulary 30522 except `tiny`) and each mode --
`0` (RECOMPUTE=0) and each recomputation policy of `--policies` (default
`attention,block`; RECOMPUTE=1 with `recompute.bert4keras.patch(policy=...)`)
-- the largest micro-batch whose training run keeps the peak memory within
`--budget-gib` is searched. The memory measured is the peak resident memory
of the process (VmHWM), or, when TensorFlow sees a GPU, the peak of the
GPU's allocator (`tf.config.experimental.get_memory_info("GPU:0")`; the
budget then defaults to the GPU's memory, from `nvidia-smi`). Every
candidate batch runs in a fresh process (`python -m benchmarks.batchfit
--worker ...`, environment `TF_KERAS=1 TF_USE_LEGACY_KERAS=1 RECOMPUTE=0|1`)
that calls `recompute.bert4keras.patch(policy=...)`,
builds the model with bert4keras's `build_transformer_model` (dropout 0.1 as in
BERT) plus a classification head (the CLS token's vector -> `Dense(2)`),
compiles it with tf_keras Adam -- wrapped in `accum.AccumOptimizer(...,
steps_per_update=k)` when `--accum-steps k` > 1 -- and runs `train_on_batch`
on random token ids with padding: one first step (graph tracing, excluded from
the timing) and `--steps` steady-state steps. It reports its peak RSS (VmHWM
from /proc/self/status) and CPU seconds (`time.process_time`, all threads) per
sample. A candidate fits when the peak RSS is within the budget. A worker whose
RSS passes `--abort-factor` x budget (1.5 by default; a watchdog thread in the
worker, and the parent as a backstop) stops itself, and one that is killed or
fails counts as not fitting; a worker already over the budget after its first
step stops there (it cannot fit).

Search, per model: RECOMPUTE=0 measures batch 1, then a second batch at
about 60% of what a rough activation estimate predicts; each policy starts at
the batch found without recomputation (so every mode shares a measured batch).
A line, peak = fixed + slope x batch, through the largest fitting batch
and one at most 80% of it (for a policy's first jump: the fixed part of
the RECOMPUTE=0 line) predicts the largest fitting batch (jumps of at most
8x). Once a batch does not fit, the measured bracket (largest batch that
fits, smallest that does not) is narrowed by interpolation, with bisection
when one end keeps moving. Allocator slack makes the line only a guide: the
answer is always a batch *measured* to fit whose successor was *measured* not
to fit (or the `--max-batch` cap).

Output: progress lines on stderr (per candidate: a line when its worker
starts, one with batch, mode, peak RSS, CPU s/sample and whether it fits when
it ends), then a table on stdout with one row per model and mode:

- `model`, `seq`, `budget GiB`, `policy` (`off`: RECOMPUTE=0);
- `max batch`: largest micro-batch that fits (`>=N` if capped by `--max-batch`,
  0 if batch 1 does not fit);
- `peak MiB`: the measured peak (VmHWM, or the GPU allocator's) at that batch;
- `CPU s/sample`: steady-state CPU seconds per training sample at that batch;
- `batch x`: max batch with the policy over max batch without;
- `time x`: CPU time per sample at the two max batches, policy over off
  (below the table also at the largest batch measured in both modes);
- `eff. batch`: effective batch = max batch x `--accum-steps`.

Below the table, per model and mode: the verification (batch N measured
within the budget, N + 1 over it) and the measured line peak RSS ~ fixed +
MiB per sample x batch (its slope is the activation memory per sample as the
process sees it, allocator slack included).

A PNG (`--plot`, default `batchfit.png` in the current directory) shows the
peak against batch, one line per mode, one panel per model, with the budget
as a horizontal line; `--json PATH` saves every measurement; `--docs PAGE`
writes the table into a docs/ page.

`--quick` (the first thing to run on a fresh machine, a few minutes on 2 CPU
cores): the real MiniLM only, sequence length 256, a 2 GiB budget, one
steady-state step per candidate; then the fine-tuning example,
`examples/bert_finetune.py --recompute --accum-steps 4` (8 updates of 4
micro-batches of 4, seq 32), on the sentence-polarity data at
`../shared/data/rt-polarity` beside the checkout if it is there, else on 40
sentences embedded here; its output follows the table and its results go
into `--json`.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

from . import harness
from .harness import GiB, MiB

TOOL = "benchmarks.batchfit"
_progress = harness.Progress(TOOL)

# Transformer shapes. `minilm` is the real model: its weights (and exact
# config) come from `recompute.bert4keras.converter.minilm()` when that is available.
SHAPES = {
    "base": dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522),
    "large": dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522),
    "minilm": dict(layers=6, hidden=384, heads=12, ffn=1536, vocab=30522),
    "tiny": dict(layers=2, hidden=64, heads=8, ffn=256, vocab=1000),
}
DROPOUT = 0.1
LEARNING_RATE = 2e-5

FULL = dict(models=("base", "large"), seq_len=512, budget_gib=8.0, steps=2)
QUICK = dict(models=("minilm",), seq_len=256, budget_gib=2.0, steps=1)

ENV = {"TF_KERAS": "1", "TF_USE_LEGACY_KERAS": "1"}
POLICIES = ("layer", "block", "attention", "block_keep_ffn")  # of recompute.bert4keras.patch


def policy_of(mode):
    """The `patch()` policy of a mode: "0" -> None (RECOMPUTE=0), "1" -> "block"."""
    return None if mode == "0" else ("block" if mode == "1" else mode)


def gpu_memory_bytes():
    """Total memory of the first GPU `nvidia-smi` reports (honouring
    CUDA_VISIBLE_DEVICES="" as none), or None."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or not lines:
        return None
    return int(float(lines[0]) * MiB)


def _mib(nbytes):
    return nbytes / MiB


# --------------------------------------------------------------------------
# Worker: one model, one mode, one batch, one process.


def _bert_config(shape, seq_len, base_config=None):
    """A bert_config.json dict for `shape` (or `base_config`, the real model's) with BERT's dropout."""
    config = dict(base_config or {})
    if not base_config:
        config.update(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            intermediate_size=shape["ffn"], hidden_act="gelu",
            max_position_embeddings=max(512, seq_len), type_vocab_size=2,
            initializer_range=0.02,
        )
    if config.get("max_position_embeddings", 512) < seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's "
                         f"max_position_embeddings {config['max_position_embeddings']}")
    config.update(hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
    return config


def build_classifier(config_path, checkpoint_path=None):
    """bert4keras BERT from `config_path` (weights from `checkpoint_path` if given) + CLS -> Dense(2).

    Call `recompute.bert4keras.patch()` before the first import of bert4keras.
    """
    from bert4keras.backend import keras
    from bert4keras.models import build_transformer_model

    bert = build_transformer_model(config_path, checkpoint_path)
    cls = keras.layers.Lambda(lambda x: x[:, 0], name="CLS")(bert.output)
    logits = keras.layers.Dense(2, name="classifier")(cls)
    return keras.Model(bert.inputs, logits)


def make_optimizer(accum_steps, learning_rate=LEARNING_RATE):
    """tf_keras Adam, wrapped in `AccumOptimizer(..., steps_per_update=accum_steps)` if > 1."""
    import tf_keras

    optimizer = tf_keras.optimizers.Adam(learning_rate)
    if accum_steps > 1:
        from accum import AccumOptimizer

        optimizer = AccumOptimizer(optimizer, steps_per_update=accum_steps)
    return optimizer


def _random_batches(n, batch, seq_len, vocab, seed):
    """`n` batches of random token ids ([CLS] first, padded tails) and random labels."""
    import numpy as np

    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        ids = rng.randint(1000 if vocab > 2000 else 1, vocab, size=(batch, seq_len))
        ids[:, 0] = 101 if vocab > 101 else 1
        # Lengths between half and all of seq_len; the longest row is full.
        lengths = rng.randint(seq_len // 2, seq_len + 1, size=batch)
        lengths[0] = seq_len
        for row, length in enumerate(lengths):
            ids[row, length:] = 0
        out.append(([ids, np.zeros_like(ids)], rng.randint(0, 2, size=batch)))
    return out


def _check_worker_env():
    missing = [f"{k}={v}" for k, v in ENV.items() if os.environ.get(k) != v]
    if missing:
        raise RuntimeError(f"bert4keras workers need {' '.join(missing)} in the environment")


def _prepare_config(spec, tmp):
    base_config = None
    if spec.get("config_path"):
        with open(spec["config_path"]) as f:
            base_config = json.load(f)
    config = _bert_config(spec["shape"], spec["seq_len"], base_config)
    path = os.path.join(tmp, "bert_config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def compiled_classifier(spec):
    """The candidate's model, seeded and compiled: `build_classifier` for `spec`
    (shape, seq_len, accum_steps, optionally config_path/checkpoint_path)
    with `make_optimizer` and a sparse cross-entropy on the logits.

    Call `recompute.bert4keras.patch()` first (as `build_classifier`)."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = _prepare_config(spec, tmp)
        model = build_classifier(config_path, spec.get("checkpoint_path"))
    model.compile(optimizer=make_optimizer(spec["accum_steps"]),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run_worker(spec, out_path):
    """Trains one candidate and writes its result as JSON to `out_path`.

    `spec`: model, shape, seq_len, batch, steps, accum_steps, budget_bytes,
    abort_bytes, and optionally config_path/checkpoint_path (real weights).
    The result: peak_rss_mib (VmHWM), fits (peak within the budget),
    cpu_s_per_sample (mean of the steady-state steps), losses, the VmHWM after
    each phase (imported, built, first_step, steady), and ok=False with an
    error when the worker ran out of memory (which counts as not fitting).
    """
    result = dict(model=spec["model"], batch=spec["batch"], seq_len=spec["seq_len"],
                  mode=spec.get("mode", os.environ.get("RECOMPUTE", "")),
                  recompute=os.environ.get("RECOMPUTE", ""), accum_steps=spec["accum_steps"])
    budget = spec["budget_bytes"]
    harness.RssWatchdog(spec["abort_bytes"], out_path, result, ok=False, fits=False).start()
    _check_worker_env()
    phases = {}

    def mark(name):
        phases[name] = harness.peak_rss_kib() / 1024.0

    def write(**fields):
        result.update(fields, phases_hwm_mib=phases)
        harness.write_result(out_path, result)

    import recompute.bert4keras

    # Before bert4keras is imported. RECOMPUTE=0 builds the "block" model too
    # (the same layers and weights; only the recomputation is off).
    recompute.bert4keras.patch(policy=policy_of(spec.get("mode", "1")) or "block")
    import tensorflow as tf
    importlib.import_module("tf_keras")  # loaded before the "imported" mark (the phases report)

    import recompute

    device = harness.measured_device()  # the GPU's allocator when there is one
    result.update(device=device, malloc=harness.malloc_setting())

    def peak_bytes():
        if device == "CPU:0":
            return harness.peak_rss_kib() * 1024
        return tf.config.experimental.get_memory_info(device)["peak"]

    mark("imported")
    model = compiled_classifier(spec)
    mark("built")
    result.update(params=int(model.count_params()), recompute_enabled=recompute.is_enabled())
    batches = _random_batches(spec["steps"] + 1, spec["batch"], spec["seq_len"],
                              spec["shape"]["vocab"], seed=spec["batch"])
    losses, cpu = [], []
    try:
        t0 = time.process_time()
        losses.append(float(model.train_on_batch(*batches[0])))  # traces the graph
        result.update(first_step_cpu_s=time.process_time() - t0)
        mark("first_step")
        if peak_bytes() > budget:
            # Over the budget already: it cannot fit, more steps would only cost time.
            return write(ok=True, fits=False, stopped_after_first_step=True,
                         peak_rss_mib=peak_bytes() / MiB, loss=losses)
        for x, y in batches[1:]:
            c0 = time.process_time()
            losses.append(float(model.train_on_batch(x, y)))
            cpu.append(time.process_time() - c0)
        mark("steady")
    except (MemoryError, tf.errors.ResourceExhaustedError) as e:
        return write(ok=False, fits=False, aborted=True, peak_rss_mib=peak_bytes() / MiB,
                     error=f"out of memory ({type(e).__name__})", loss=losses)
    peak = peak_bytes()
    # `peak_rss_mib` is the measured peak: VmHWM, or the GPU allocator's (`device`).
    write(ok=True, fits=peak <= budget, peak_rss_mib=peak / MiB,
          host_peak_rss_mib=harness.peak_rss_kib() / 1024.0, cpu_s_per_step=cpu,
          cpu_s_per_sample=sum(cpu) / len(cpu) / spec["batch"], loss=losses,
          stopped_after_first_step=False)


# --------------------------------------------------------------------------
# Parent: spawn workers, search, report.


def _wait_for_memory(need_bytes, max_wait_s=900):
    """Waits (up to `max_wait_s`) until the machine has `need_bytes` available; warns otherwise."""
    start = time.time()
    warned = False
    while True:
        available = harness.mem_available_bytes()
        if available is None or available >= need_bytes:
            return
        if time.time() - start > max_wait_s:
            _progress(f"warning: only {_mib(available):.0f} MiB available, starting anyway")
            return
        if not warned:
            _progress(f"waiting for memory: {_mib(available):.0f} MiB available, "
                      f"the worker may use up to {_mib(need_bytes):.0f} MiB")
            warned = True
        time.sleep(10)


def measure(model, shape, mode, batch, opts, paths=None):
    """Runs one candidate in a fresh worker process; returns its result dict (with `fits`)."""
    budget = int(opts["budget_gib"] * GiB)
    abort = int(budget * opts["abort_factor"])
    spec = dict(model=model, shape=shape, batch=batch, seq_len=opts["seq_len"], mode=mode,
                steps=opts["steps"], accum_steps=opts["accum_steps"],
                budget_bytes=budget, abort_bytes=abort, **(paths or {}))
    _wait_for_memory(budget + 256 * MiB)
    _progress(f"{model} seq {opts['seq_len']} {_label(mode)} batch {batch:>4}: "
              "measuring in a fresh process ...")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        c0 = time.time()
        env = dict(ENV, RECOMPUTE="0" if mode == "0" else "1",
                   CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                   **harness.malloc_env(opts.get("malloc", "default")))
        run, = harness.run_workers(_progress, ["--spec", spec_path], [env],
                                   rss_abort_bytes=int(abort * 1.05) + 64 * MiB)
        wall = time.time() - c0
    result = run.result
    if result is None:
        # Killed (by a signal: the parent's backstop, the kernel's OOM killer)
        # means it does not fit; any other failure is a bug worth stopping for.
        if run.code >= 0 and run.killed is None:
            sys.stderr.write(run.tail)
            raise RuntimeError(f"worker {model} {_label(mode)} batch={batch} failed "
                               f"with exit code {run.code}; its last stderr lines are above")
        result = dict(model=model, batch=batch, mode=mode, ok=False, fits=False,
                      aborted=True, peak_rss_mib=run.peak_rss_kib / 1024.0, error=run.failure())
    result["wall_s"] = wall
    result.setdefault("cpu_s_per_sample", None)
    verdict = "fits" if result["fits"] else "does NOT fit"
    if result.get("aborted"):
        verdict += f" (aborted: {result.get('error')})"
    elif result.get("stopped_after_first_step"):
        verdict += " (over budget after the first step: stopped)"
    cps = result.get("cpu_s_per_sample")
    _progress(f"{model} seq {opts['seq_len']} {_label(mode)} batch {batch:>4}: "
              f"peak {result['peak_rss_mib']:8.0f} MiB, "
              + (f"{cps:7.3f} CPU s/sample" if cps is not None else "      - CPU s/sample")
              + f" -> {verdict} (budget {_mib(budget):.0f} MiB; {wall:.0f} s wall)")
    return result


def _label(mode):
    """How progress lines and notes name a mode."""
    return "RECOMPUTE=0" if mode == "0" else f"policy={policy_of(mode)}"


def activation_estimate_mib(shape, seq_len, mode):
    """A rough a-priori activation memory per sample (MiB) of one training step.

    Only used to choose the second batch of a search (the measurements decide
    everything else). One block's activations: about six [heads, seq, seq]
    attention tensors, five [seq, ffn] and twenty [seq, hidden] tensors
    (float32). RECOMPUTE=0: 0.7 x that per layer (the allocator reuses some;
    calibrated on MiniLM and BERT-base). Policy "block" (each Transformer
    block one unit): one [seq, hidden] input per layer plus one block's
    activations, while it is recomputed; "layer": about seven [seq, hidden]
    tensors per layer plus that; "attention": RECOMPUTE=0 without the
    attention tensors, plus one layer's; "block_keep_ffn": "block" plus one
    [seq, hidden] product per layer.
    """
    s, d, f, h, n = seq_len, shape["hidden"], shape["ffn"], shape["heads"], shape["layers"]
    block = 6 * h * s * s + 5 * s * f + 20 * s * d
    policy = policy_of(mode)
    if policy is None:
        floats = 0.7 * n * block
    elif policy == "attention":
        floats = 0.7 * n * (5 * s * f + 20 * s * d) + 6 * h * s * s
    elif policy == "layer":
        floats = 7 * n * s * d + block
    elif policy == "block_keep_ffn":
        floats = 2 * n * s * d + block
    else:
        floats = n * s * d + block
    return floats * 4 / MiB


class Search:
    """The measured bracket of one (model, mode): which batches fit, and what to try next.

    `prior` is a list of (batch, peak RSS MiB) points from elsewhere (the
    RECOMPUTE=0 line's value at batch 0) that only help draw the first line.
    """

    def __init__(self, budget_mib, max_batch, prior=()):
        self.budget_mib = budget_mib
        self.max_batch = max_batch
        self.prior = list(prior)
        self.runs = {}  # batch -> result
        self.moves = []  # "lo" / "hi": which end of the bracket each measurement moved

    @property
    def hi(self):
        """Smallest batch measured not to fit (None if none)."""
        failing = [b for b, r in self.runs.items() if not r["fits"]]
        return min(failing) if failing else None

    @property
    def lo(self):
        """Largest batch measured to fit below `hi` (0 if none)."""
        hi = self.hi
        fitting = [b for b, r in self.runs.items() if r["fits"] and (hi is None or b < hi)]
        return max(fitting) if fitting else 0

    def done(self):
        """True when `lo` fits and `lo + 1` was measured not to fit, or `lo` is the cap."""
        lo, hi = self.lo, self.hi
        return (hi is not None and hi == lo + 1) or (hi is None and lo >= self.max_batch)

    def _fitting_points(self):
        return sorted((b, r["peak_rss_mib"]) for b, r in self.runs.items()
                      if r["fits"] and b <= self.lo)

    @staticmethod
    def _span(points):
        """The line through the largest batch and one at most 80% of it (the largest such).

        Adjacent batches differ by less than the allocator's noise, so a line
        through them could point anywhere; the partner is taken further away.
        """
        if len(points) < 2:
            return None
        top = points[-1]
        partners = [p for p in points[:-1] if p[0] <= 0.8 * top[0]] or points[:1]
        if partners[-1][0] == top[0]:
            return None
        slope, intercept = harness.slope([partners[-1], top])
        return (slope, intercept) if slope > 0 else None

    def own_line(self):
        """(slope, intercept) of peak RSS (MiB) vs batch from this mode's fitting batches, or None."""
        return self._span(self._fitting_points())

    def _line(self):
        """`own_line()`, or with fewer than two measurements the line through `prior` too."""
        points = self._fitting_points()
        if len(points) < 2:
            points = sorted(set(self.prior) | set(points))
        return self._span(points)

    def next_batch(self):
        """The next candidate to measure, or None when the answer is verified."""
        if self.done():
            return None
        lo, hi = self.lo, self.hi
        if hi is None:
            line = self._line()
            if line is None:
                guess = 2 * lo
            else:
                slope, fixed = line
                guess = int((self.budget_mib - fixed) // slope)
                guess = min(guess, 8 * max(lo, 1))  # at most 8x per jump
            return min(max(guess, lo + 1), self.max_batch)
        # Bracketed: interpolate between the measured ends (regula falsi); if the
        # same end moved three times in a row, bisect instead.
        rss_hi = self.runs[hi]["peak_rss_mib"]
        rss_lo = self.runs[lo]["peak_rss_mib"] if lo else None
        if rss_lo is not None and rss_hi > rss_lo:
            guess = lo + int((self.budget_mib - rss_lo) / (rss_hi - rss_lo) * (hi - lo))
        else:
            guess = (lo + hi) // 2
        if len(self.moves) >= 3 and len(set(self.moves[-3:])) == 1:
            guess = (lo + hi) // 2
        return min(max(guess, lo + 1), hi - 1)

    def add(self, result):
        """Records one measured candidate."""
        self.runs[result["batch"]] = result
        self.moves.append("lo" if result["fits"] else "hi")

    def answer(self):
        """(max batch, capped?, the result at it or None)."""
        lo = self.lo
        capped = self.hi is None and lo >= self.max_batch
        return lo, capped, self.runs.get(lo)


def _refit(result, budget_mib):
    """`result` (measured under another budget) judged against `budget_mib`."""
    result = dict(result)
    result["fits"] = bool(result.get("ok") and not result.get("aborted")
                          and not result.get("stopped_after_first_step")
                          and result["peak_rss_mib"] <= budget_mib)
    return result


def search(model, shape, mode, opts, paths=None, first=None, prior=(), known=(),
           measure_fn=None):
    """Finds the largest fitting batch of one model and mode; returns a summary dict.

    Measures batch `first` (default 1), then a second batch chosen from the
    first measurement and `activation_estimate_mib` (about 60% of the
    predicted maximum), then follows `Search.next_batch` until the answer is
    verified. For a policy, `first` is the batch found with RECOMPUTE=0
    (both modes then share a batch, for the same-batch time ratio) and `prior`
    the RECOMPUTE=0 line's value at batch 0 (fixed memory, shared by every mode). `known`: results measured earlier (judged
    again against this budget). `measure_fn(model, shape, mode, batch, opts,
    paths)` defaults to `measure` (a fresh worker process).
    """
    measure_fn = measure_fn or measure
    budget_mib = opts["budget_gib"] * 1024.0
    s = Search(budget_mib, opts["max_batch"], prior)
    for r in known:
        s.add(_refit(r, budget_mib))
    first = min(first or 1, opts["max_batch"])
    if first not in s.runs:
        s.add(measure_fn(model, shape, mode, first, opts, paths))
    if s.runs[first]["fits"] and not s.done() and len(s.runs) == 1 and not s.prior:
        per_sample = activation_estimate_mib(shape, opts["seq_len"], mode)
        room = budget_mib - s.runs[first]["peak_rss_mib"]
        second = first + max(1, int(0.6 * room / per_sample))
        second = min(second, opts["max_batch"])
        if second not in s.runs:
            s.add(measure_fn(model, shape, mode, second, opts, paths))
    while True:
        batch = s.next_batch()
        if batch is None:
            break
        s.add(measure_fn(model, shape, mode, batch, opts, paths))
    best, capped, at = s.answer()
    verified_next = s.runs.get(best + 1)
    return dict(
        model=model, mode=mode, max_batch=best, capped=capped,
        peak_rss_mib=at["peak_rss_mib"] if at else None,
        cpu_s_per_sample=at.get("cpu_s_per_sample") if at else None,
        next_batch_peak_rss_mib=verified_next["peak_rss_mib"] if verified_next else None,
        line=s.own_line(),
        runs=[s.runs[b] for b in sorted(s.runs)],
    )


def _ratio(a, b):
    if a is None or b is None:
        return None
    if b == 0:
        return float("inf") if a else None
    return a / b


def _same_batch_time_ratio(off, on):
    """(batch, on/off CPU s/sample) at the largest batch both modes measured and fit."""
    both = {r["batch"]: r for r in off["runs"] if r["fits"] and r.get("cpu_s_per_sample")}
    common = [(b, r) for b, r in ((r["batch"], r) for r in on["runs"])
              if b in both and r["fits"] and r.get("cpu_s_per_sample")]
    if not common:
        return None, None
    b, r = max(common, key=lambda t: t[0])
    return b, r["cpu_s_per_sample"] / both[b]["cpu_s_per_sample"]


def summarize(results, opts):
    """Per model and policy: the ratios to RECOMPUTE=0 of max batch and time per sample."""
    rows = []
    for model in opts["models"]:
        off = results.get((model, "0"))
        mine = [results[(model, mode)] for mode in opts["modes"] if (model, mode) in results]
        for res in mine:
            res["effective_batch"] = res["max_batch"] * opts["accum_steps"]
            if off and res is not off:
                res["batch_ratio"] = _ratio(res["max_batch"], off["max_batch"])
                res["time_ratio"] = _ratio(res["cpu_s_per_sample"], off["cpu_s_per_sample"])
                res["same_batch"], res["same_batch_time_ratio"] = _same_batch_time_ratio(off, res)
        rows += mine
    return rows


def _fmt(value, spec, none="-"):
    if value is None:
        return none
    if value == float("inf"):
        return "inf"
    return format(value, spec)


def print_report(rows, opts, out=None):
    """The results table (see the module docstring for the columns)."""
    out = sys.stdout if out is None else out  # the current one: report_to_docs redirects it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("what batch fits? bert4keras BERT + CLS->Dense(2), tf_keras Adam"
      + (f" in AccumOptimizer(k={opts['accum_steps']})" if opts["accum_steps"] > 1 else "")
      + f", dropout {DROPOUT}; peak {_measured(rows)} of a fresh process per candidate"
      + f"; CPU allocation: {opts.get('malloc', 'default')} (--malloc)")
    p("")
    header = (f"{'model':<8} {'seq':>5} {'budget GiB':>10} {'policy':>9} {'max batch':>9} "
              f"{'peak MiB':>9} {'CPU s/sample':>12} {'batch x':>8} "
              f"{'time x':>7} {'eff. batch':>10}")
    p(header)
    p("-" * len(header))
    for r in rows:
        mb = (">=" if r["capped"] else "") + str(r["max_batch"])
        ratio = _fmt(r.get("batch_ratio"), ".2f")
        if r.get("batch_ratio") is not None:
            off_capped = any(o["capped"] for o in rows if o["model"] == r["model"] and o["mode"] == "0")
            ratio = "-" if off_capped else (">=" + ratio if r["capped"] else ratio)
        p(f"{r['model']:<8} {opts['seq_len']:>5} {opts['budget_gib']:>10g} "
          f"{policy_of(r['mode']) or 'off':>9} "
          f"{mb:>9} {_fmt(r['peak_rss_mib'], '.0f'):>9} {_fmt(r['cpu_s_per_sample'], '.3f'):>12} "
          f"{ratio:>8} {_fmt(r.get('time_ratio'), '.2f'):>7} "
          f"{r['effective_batch']:>10}")
    notes = []
    for r in rows:
        tag = f"{r['model']} {_label(r['mode'])}:"
        if r["max_batch"] and r.get("next_batch_peak_rss_mib") is not None:
            text = (f"{tag} batch {r['max_batch']} measured {r['peak_rss_mib']:.0f} MiB (fits), "
                    f"batch {r['max_batch'] + 1} measured {r['next_batch_peak_rss_mib']:.0f} MiB "
                    "(does not)")
        elif r["max_batch"] == 0:
            text = f"{tag} even batch 1 does not fit ({r['runs'][0]['peak_rss_mib']:.0f} MiB)"
        else:
            text = f"{tag} batch {r['max_batch']} measured {_fmt(r['peak_rss_mib'], '.0f')} MiB (cap)"
        line = rss_line(r)
        if line:
            text += (f"; peak ~ {line[1]:.0f} + {line[0]:.0f} MiB x batch "
                     f"(batches {line[2]} and {line[3]})")
        notes.append(text)
        if r["mode"] != "0" and r.get("same_batch"):
            notes.append(f"{r['model']} {_label(r['mode'])}: CPU time per sample over "
                         f"RECOMPUTE=0's at the same batch {r['same_batch']}: "
                         f"x{r['same_batch_time_ratio']:.3f}")
    if notes:
        p("")
        for n in notes:
            p(n)


def _measured(rows):
    """What the peaks are: "RSS (VmHWM)" or "GPU:0 allocator"."""
    devices = {run.get("device", "CPU:0") for r in rows for run in r["runs"]}
    return "RSS (VmHWM)" if devices <= {"CPU:0"} else f"{'/'.join(sorted(devices))} allocator"


def rss_line(row):
    """(MiB per sample, MiB at batch 0, batch a, batch b): the line through two fitting batches, or None.

    b is the largest fitting batch, a the largest fitting batch at most 80% of b.
    """
    points = sorted((r["batch"], r["peak_rss_mib"]) for r in row["runs"]
                    if r["fits"] and r["batch"] <= row["max_batch"])
    line = Search._span(points)
    if line is None:
        return None
    partner = [p for p in points[:-1] if p[0] <= 0.8 * points[-1][0]] or points[:1]
    return line[0], line[1], partner[-1][0], points[-1][0]


def plot(rows, opts, path):
    """PNG: peak vs batch per model (one panel each), one line per mode, budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in opts["models"] if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    budget = opts["budget_gib"] * 1024.0
    styles = {"0": dict(color="tab:red", marker="o", label="RECOMPUTE=0"),
              "1": dict(color="tab:blue", marker="s", label="policy=block"),
              "layer": dict(color="tab:green", marker="^", label="policy=layer"),
              "block": dict(color="tab:blue", marker="s", label="policy=block"),
              "attention": dict(color="tab:orange", marker="D", label="policy=attention"),
              "block_keep_ffn": dict(color="tab:purple", marker="v", label="policy=block_keep_ffn")}
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r["model"] != model:
                continue
            st = styles[r["mode"]]
            runs = sorted(r["runs"], key=lambda x: x["batch"])
            xs = [x["batch"] for x in runs]
            ys = [x["peak_rss_mib"] / 1024.0 for x in runs]
            ax.plot(xs, ys, color=st["color"], lw=1, alpha=0.6)
            ok = [(x, y) for x, y, run in zip(xs, ys, runs) if run["fits"]]
            bad = [(x, y) for x, y, run in zip(xs, ys, runs) if not run["fits"]]
            if ok:
                ax.scatter(*zip(*ok), color=st["color"], marker=st["marker"],
                           label=f"{st['label']}: max batch {r['max_batch']}", zorder=3)
            if bad:
                ax.scatter(*zip(*bad), facecolors="none", edgecolors=st["color"],
                           marker=st["marker"], zorder=3)
        ax.axhline(budget / 1024.0, color="k", ls="--", lw=1,
                   label=f"budget {opts['budget_gib']:g} GiB")
        ax.set_title(f"{model}, seq {opts['seq_len']}"
                     + (f", AccumOptimizer k={opts['accum_steps']}" if opts["accum_steps"] > 1 else ""))
        ax.margins(x=0.05, y=0.08)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel(f"peak {_measured(rows)} (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("What batch fits? (filled: fits, hollow: does not)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# The real MiniLM and the --quick fine-tuning run.


def minilm_paths():
    """{"config_path", "checkpoint_path", "vocab_path"} of the converted MiniLM, or None.

    Uses `recompute.bert4keras.converter.minilm()` (converted once, then cached) when
    that module exists; None otherwise (the MiniLM shape with random weights).
    """
    try:
        from recompute.bert4keras import converter as hf_convert
    except ImportError:
        _progress("recompute.bert4keras.converter is not available: MiniLM gets random weights "
                  "(same shape)")
        return None
    try:
        converted = hf_convert.minilm()
    except (ImportError, OSError) as e:  # the MiniLM package is not installed
        _progress(f"no MiniLM weights ({e}): MiniLM gets random weights (same shape)")
        return None
    return dict(config_path=str(converted.config_path),
                checkpoint_path=str(converted.checkpoint_path),
                vocab_path=str(converted.vocab_path))


# 40 short sentences written for the --quick fine-tuning demo (not from any data
# set; used when the shared sentence-polarity data is absent): 1 = positive.
SENTENCES = [
    ("a warm, funny and beautifully acted film", 1),
    ("the best movie i have seen this year", 1),
    ("a delightful story with a big heart", 1),
    ("smart, moving and wonderfully made", 1),
    ("the cast is superb and the script sparkles", 1),
    ("i loved every minute of it", 1),
    ("a charming and clever comedy", 1),
    ("gorgeous images and a touching score", 1),
    ("an inspiring, joyful experience", 1),
    ("the director delivers a triumph", 1),
    ("tense, thrilling and never dull", 1),
    ("a genuinely sweet and uplifting tale", 1),
    ("brilliant performances all around", 1),
    ("funny, fresh and full of surprises", 1),
    ("a masterpiece of quiet emotion", 1),
    ("i would happily watch it again", 1),
    ("a lovely, honest little film", 1),
    ("the ending is perfect and earned", 1),
    ("great fun for the whole family", 1),
    ("a rich and rewarding drama", 1),
    ("a dull, lifeless and boring film", 0),
    ("the worst movie i have seen this year", 0),
    ("a tedious story with no heart", 0),
    ("stupid, clumsy and badly made", 0),
    ("the cast is wasted and the script is awful", 0),
    ("i hated every minute of it", 0),
    ("a lazy and unfunny comedy", 0),
    ("ugly images and an annoying score", 0),
    ("a depressing, miserable experience", 0),
    ("the director delivers a disaster", 0),
    ("slow, predictable and always dull", 0),
    ("a cynical and mean spirited tale", 0),
    ("terrible performances all around", 0),
    ("unfunny, stale and full of cliches", 0),
    ("a mess of forced emotion", 0),
    ("i would never watch it again", 0),
    ("a pointless, dishonest little film", 0),
    ("the ending is silly and unearned", 0),
    ("a waste of time for everyone", 0),
    ("a shallow and tiresome drama", 0),
]


EXAMPLE = os.path.join(harness.CHECKOUT, "examples", "bert_finetune.py")
SHARED_DATA = os.path.join(os.path.dirname(harness.CHECKOUT), "shared", "data", "rt-polarity")


def demo_data(folder, shared=SHARED_DATA):
    """The sentence-polarity directory `shared` if it exists, else `SENTENCES` as a TSV in `folder`."""
    if os.path.isdir(shared):
        return shared
    path = os.path.join(folder, "sentences.tsv")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{label}\t{text}\n" for text, label in SENTENCES)
    return path


def finetune_command(data, json_path):
    """The fine-tuning example with recomputation and accumulation, small settings."""
    return [sys.executable, EXAMPLE, "--data", data, "--recompute", "--accum-steps", "4",
            "--batch-size", "4", "--seq-len", "32", "--max-steps", "8", "--lr", "1e-4",
            "--json", json_path]


def finetune_demo(shared=SHARED_DATA):
    """Runs `examples/bert_finetune.py` (`finetune_command`) on `demo_data`; returns its results.

    Its output goes to this process's stdout and stderr.
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = demo_data(tmp, shared)
        out = os.path.join(tmp, "finetune.json")
        cmd = finetune_command(data, out)
        _progress("fine-tuning demo: python examples/bert_finetune.py " + " ".join(cmd[2:-2]))
        sys.stdout.flush()
        code = subprocess.run(cmd, env=harness.worker_env(**ENV)).returncode
        if code != 0 or not os.path.exists(out):
            raise RuntimeError(f"the fine-tuning demo (examples/bert_finetune.py) failed with "
                               f"exit code {code} (its output is above)")
        with open(out) as f:
            return json.load(f)


# --------------------------------------------------------------------------
# Command line.


_models = harness.name_list(tuple(SHAPES))
_policies = harness.name_list(POLICIES)
_abort_factor = harness.float_above(1.0)


def parse_args(argv=None):
    """Parses the command line (see the module docstring); errors name what was expected."""
    parser = harness.parser(
        "benchmarks.batchfit",
        "Largest micro-batch of a bert4keras BERT that trains within a memory budget "
        "(peak RSS), with RECOMPUTE=0 and RECOMPUTE=1; each candidate batch in a fresh "
        "process.",
    )
    parser.add_argument("--models", type=_models,
                        help=f"comma-separated, from {','.join(SHAPES)} "
                             f"(default {','.join(FULL['models'])}; --quick: minilm)")
    parser.add_argument("--seq-len", type=harness.positive_int,
                        help=f"sequence length (default {FULL['seq_len']}; --quick: {QUICK['seq_len']})")
    parser.add_argument("--budget-gib", type=harness.positive_float,
                        help=f"peak memory budget in GiB (default {FULL['budget_gib']:g}; "
                             f"--quick: {QUICK['budget_gib']:g}; with a GPU: its memory)")
    parser.add_argument("--policies", type=_policies,
                        help="comma-separated recomputation policies measured beside "
                             "RECOMPUTE=0, from layer,block,attention,block_keep_ffn "
                             "(default attention,block)")
    parser.add_argument("--accum-steps", type=harness.positive_int, default=1,
                        help="wrap Adam in AccumOptimizer(steps_per_update=K) when K > 1 "
                             "(default 1: plain Adam)")
    parser.add_argument("--steps", type=harness.positive_int,
                        help=f"steady-state steps timed after the first (default "
                             f"{FULL['steps']}; --quick: {QUICK['steps']})")
    parser.add_argument("--max-batch", type=harness.positive_int, default=512,
                        help="largest batch tried (default 512)")
    parser.add_argument("--abort-factor", type=_abort_factor, default=1.5,
                        help="a worker stops itself above this multiple of the budget (default 1.5)")
    parser.add_argument("--quick", action="store_true",
                        help="real MiniLM, seq 256, 2 GiB, 1 step, then a short run of "
                             "examples/bert_finetune.py --recompute --accum-steps 4 (a few "
                             "minutes on 2 cores); explicit options override it")
    parser.add_argument("--plot", metavar="PATH", default="batchfit.png",
                        help="PNG of peak RSS vs batch (default batchfit.png)")
    harness.add_output_arguments(parser, TOOL, malloc=True)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)

    defaults = QUICK if args.quick else FULL
    gpu_bytes = gpu_memory_bytes() if args.budget_gib is None and not args.worker else None
    if gpu_bytes is not None:
        args.budget_gib = gpu_bytes / GiB
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.policies = args.policies or ("attention", "block")
    if args.worker and not (args.spec and args.out):
        parser.error("--worker needs --spec and --out")
    for name in ("json", "plot"):
        if getattr(args, name):
            harness.existing_folder(parser, f"--{name}", getattr(args, name))
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot: expected a path ending in .png, got {args.plot!r}")
    for model in args.models:
        if model in SHAPES and SHAPES[model]["hidden"] % SHAPES[model]["heads"]:
            parser.error(f"{model}: hidden not divisible by heads")
    return args


def main(argv=None):
    """Entry point of `python -m benchmarks.batchfit`; returns the exit code."""
    try:
        return _main(argv)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(argv=None):
    args = parse_args(argv)
    if args.worker:
        with open(args.spec) as f:
            run_worker(json.load(f), args.out)
        return 0

    opts = dict(models=args.models, modes=("0",) + tuple(args.policies),
                seq_len=args.seq_len, budget_gib=args.budget_gib,
                accum_steps=args.accum_steps, steps=args.steps, max_batch=args.max_batch,
                abort_factor=args.abort_factor, malloc=args.malloc)
    start_wall, start_cpu = time.time(), _children_cpu()
    paths = {}
    if "minilm" in args.models or args.quick:
        paths["minilm"] = minilm_paths()
        if paths["minilm"] is not None:
            _progress(f"real MiniLM weights: {paths['minilm']['checkpoint_path']}")
    results = {}
    for model in args.models:
        shape = SHAPES[model]
        model_paths = paths.get(model) or {}
        worker_paths = {k: v for k, v in model_paths.items() if k != "vocab_path"}
        off = search(model, shape, "0", opts, worker_paths)
        results[(model, "0")] = off
        # The RECOMPUTE=0 line's intercept (memory at batch 0: weights,
        # optimizer, runtime) is shared by every mode.
        prior = [(0, off["line"][1])] if off["line"] else []
        for policy in args.policies:
            results[(model, policy)] = search(model, shape, policy, opts, worker_paths,
                                              first=off["max_batch"] or 1, prior=prior)
    rows = summarize(results, opts)
    with harness.report_to_docs(args.docs, TOOL, argv):
        print_report(rows, opts)
    tune = None
    if args.quick:
        print("", flush=True)
        if paths.get("minilm") is None:
            _progress("no real MiniLM weights: the fine-tuning demo (examples/bert_finetune.py, "
                      "which needs them) is skipped")
        else:
            tune = finetune_demo()
    if args.plot:
        plot(rows, opts, args.plot)
        _progress(f"plot written to {os.path.abspath(args.plot)}")
    cpu = _children_cpu() - start_cpu + time.process_time()
    _progress(f"done in {time.time() - start_wall:.0f} s wall, {cpu:.0f} CPU s (all processes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(options=opts, results=rows, finetune=tune), f, indent=2)
        _progress(f"results saved to {os.path.abspath(args.json)}")
    return 0


def _children_cpu():
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
