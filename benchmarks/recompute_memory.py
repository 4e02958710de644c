"""Memory/time benchmark of the recomputation policies on a BERT-base-shaped encoder.

    python -m benchmarks.recompute_memory            # lean Keras 3 block, 12 x 768, seq 512 (slow)
    python -m benchmarks.recompute_memory --model standard      # keras.layers.MultiHeadAttention
    python -m benchmarks.recompute_memory --model standard --paired   # time ratios in one process
    python -m benchmarks.recompute_memory --model standard --modes 0,full --paired --batch-cut 0
                                                     # "full" with whole batches (no cuts)
    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m benchmarks.recompute_memory --model bert4keras
    python -m benchmarks.recompute_memory --model standard --modes attention --held
                                                     # what the step holds at its peak, by op
    python -m benchmarks.recompute_memory --quick    # tiny shape, for CI
    python -m benchmarks.recompute_memory --layers 4 --seq 256 --json out.json
    python -m benchmarks.recompute_memory --backend jax --layers 8   # Keras 3 on JAX, standard block

Models (`--model`) and their modes (`--modes`, default: all of them): `lean`
and `standard`, the Keras 3 encoders of `benchmarks.encoder` (modes `0`,
`full`, and for `standard` `attention`); `bert4keras`, bert4keras's BERT with
a CLS classifier and tf_keras Adam, patched with
`recompute.bert4keras.patch(policy=...)` (modes `0`, `layer`, `block`,
`attention`; its workers get `TF_KERAS=1 TF_USE_LEGACY_KERAS=1`). Mode `0`
is RECOMPUTE=0; each other mode is RECOMPUTE=1 with that policy (`1` means
the model's first policy).

Every configuration (one mode, one batch size) runs in a fresh subprocess
(`python -m benchmarks.recompute_memory --worker ...`), which builds the
model, traces and warms up one compiled training step, and then measures:

- activation memory: TensorFlow's allocator peak (the GPU's when TensorFlow
  sees one, else the CPU's; the report names it) during a step minus the
  allocator's `current` bytes just before it (stats reset before the step),
  the median over `--steps` steps after two warm-up steps (the workers get
  `TF_ENABLE_ONEDNN_OPTS=1` unless it is set: without oneDNN the CPU
  allocator keeps no statistics);
- peak RSS of the process (VmHWM);
- CPU seconds per step (`time.process_time`, all threads), the median of
  those steps: on shared cores a step now and then takes far longer (other
  work, spinning thread pools), which a mean would carry into the ratio;
  every step's value is in the JSON.

`--paired` (TensorFlow backend) runs every configuration in one worker
process instead: a model per mode, its step traced at each batch size with
recomputation on or off (`recompute.recompute_scope`), one warm-up round,
then `--steps` rounds of one measured step per configuration in turn. A
round's steps share the load of these shared cores, so the CPU time ratio
reported is the median of the rounds' ratios (each round's is printed). The
allocator figures are per step as above (the other models' weights are in
`current` and cancel), but in one process they measured higher and more
variable than in fresh ones (the standard block at BERT-base shape: "full"
137 MiB per sample against 93 to 105 in fresh processes, its steps at batch
4 from 426 to 510 MiB): take the memory from a run without `--paired`. The
peak RSS is the process's, so it has no slope.

Per-sample activation memory is the slope between the batch sizes (fixed costs
such as gradients and optimizer temporaries cancel). The parent prints a table
and, per mode, the ratios to mode 0: per-sample memory 0/mode, CPU time per
step mode/0. Progress goes to stderr; `--json PATH` saves the results;
`--docs PAGE` writes the report into a docs/ page.

`--held` (TensorFlow, fresh processes) also prints what each configuration's last
measured step holds at its peak, from TensorFlow's allocation log: the tensors made in
the step, grouped by the op that made them, and which groups grow per sample
(`benchmarks.held`). Logging slows the steps: take times from a run without it.
"""

import json
import os
import sys
import time

from . import encoder, harness, held
from .harness import MiB

FULL = dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522,
            batch_sizes=(2, 6), steps=3, dropout=0.1)
QUICK = dict(layers=3, hidden=256, heads=4, ffn=1024, seq=128, vocab=1000,
             batch_sizes=(2, 6), steps=2, dropout=0.1)
MODELS = {"lean": ("full",), "standard": ("full", "attention"),
          "bert4keras": ("layer", "block", "attention", "block_keep_ffn")}  # model -> its policies
TOOL = "benchmarks.recompute_memory"
_progress = harness.Progress(TOOL)


# --------------------------------------------------------------------------
# Worker: one configuration, one process.


def _keras3_model(cfg, model_name, policy):
    """(one training step as a function of a batch, parameter count, batches): Keras 3
    encoder; `batches(batch, n)` gives n fresh random batches (random labels: the loss
    stays near log(2) instead of collapsing on a memorised batch)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    model, _, train_step = encoder.build_model(cfg, block=model_name, policy=policy)
    n_params = int(sum(int(tf.size(v)) for v in model.trainable_variables))

    def batches(batch, n):
        rng = tf.random.Generator.from_seed(batch)
        return [(rng.uniform([batch, cfg["seq"]], 0, cfg["vocab"], dtype=tf.int32),
                 rng.uniform([batch], 0, 2, dtype=tf.int32)) for _ in range(n)]

    return (lambda b: float(train_step(*b).numpy())), n_params, batches


def _bert4keras_model(cfg, policy):
    """The same for bert4keras's BERT (padded random token ids), patched with `policy`."""
    import recompute.bert4keras

    from . import batchfit

    recompute.bert4keras.patch(policy=policy)  # before bert4keras is imported
    import tempfile

    import tf_keras

    shape = {k: cfg[k] for k in ("layers", "hidden", "heads", "ffn", "vocab")}
    config = batchfit._bert_config(shape, cfg["seq"])
    config.update(hidden_dropout_prob=cfg["dropout"], attention_probs_dropout_prob=cfg["dropout"])
    # Replayable RNG: every mode draws the masks of mode 0 (the losses match).
    tf_keras.backend.experimental.enable_tf_random_generator()
    tf_keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bert_config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        model = batchfit.build_classifier(path)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-4),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def batches(batch, n):
        return batchfit._random_batches(n, batch, cfg["seq"], cfg["vocab"], seed=batch)

    return (lambda b: float(model.train_on_batch(*b))), int(model.count_params()), batches


def saved_residual_bytes(fn, primals):
    """Bytes of what JAX keeps for the backward pass of `fn(primals)`: the leaves of
    `jax.vjp(fn, primals)`'s VJP function, their shapes found by `jax.eval_shape`
    (nothing is allocated). `primals` (the weights) are among them."""
    import jax
    import numpy as np

    def residuals(primals):
        return jax.vjp(fn, primals)[1]

    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(jax.eval_shape(residuals, primals)))


def _jax_worker(cfg, policy, batch, steps):
    """Keras 3 on JAX: (result fields, progress text) of the standard encoder at `batch`.

    What the backward pass keeps is JAX's saved residuals: the leaves of the
    VJP of the loss (`jax.vjp`, shapes by `jax.eval_shape`: nothing is
    allocated), weights included (they cancel in the per-sample slope). Also
    reported: the temporary buffer XLA's compiled step allocates
    (`memory_analysis().temp_size_in_bytes`), and CPU seconds of the jitted
    `value_and_grad` step.
    """
    import jax
    import numpy as np

    model, loss_fn = encoder.build_jax_model(cfg, policy)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    rng = np.random.default_rng(batch)
    batches = [(rng.integers(0, cfg["vocab"], (batch, cfg["seq"])).astype("int32"),
                rng.integers(0, 2, (batch,)).astype("int32")) for _ in range(steps + 2)]

    residual_bytes = saved_residual_bytes(
        lambda t: loss_fn(t, non_trainable, *batches[0])[0], trainable)
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    compiled = step.lower(trainable, non_trainable, *batches[0]).compile()
    analysis = compiled.memory_analysis()
    temp = int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1
    cpu, wall, losses = [], [], []
    for i, (ids, labels) in enumerate(batches):
        t0, w0 = time.process_time(), time.perf_counter()
        (loss, non_trainable), grads = compiled(trainable, non_trainable, ids, labels)
        jax.block_until_ready(grads)
        if i >= 2:  # after two warm-up steps
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - w0)
            losses.append(float(loss))
    n_params = int(sum(int(np.prod(v.shape)) for v in model.trainable_variables))
    fields = dict(device="jax " + jax.default_backend(), activation_bytes=int(residual_bytes),
                  activation_bytes_per_step=[int(residual_bytes)], xla_temp_bytes=temp,
                  cpu_s_per_step=harness.lower_median(cpu), cpu_s_per_step_each=cpu,
                  wall_s_per_step=sum(wall) / len(wall), loss=losses[0], params=n_params)
    text = (f"saved residuals {residual_bytes / MiB:.1f} MiB, XLA temp {temp / MiB:.1f} MiB; "
            f"{fields['cpu_s_per_step']:.2f} CPU s/step")
    return fields, text


def run_worker(cfg, model_name, mode, batch, steps, out_path, backend="tensorflow",
               build=None, progress=None, held_log=None):
    """One configuration in this (worker) process; writes its result to `out_path`.

    `build(cfg, model_name, mode)` gives (step, parameter count, batches) as
    `_model` does (default `_model`); `progress` prints the progress lines
    (default this tool's): `benchmarks.lm_memory` measures keras-hub models
    with them (TensorFlow backend). `held_log`: the file the worker's allocation log goes
    to (`--held`, `held.capture`): its last measured step is marked and read back
    (`held.read`) into the result's `held`."""
    import recompute

    build, say = build or _model, progress or _progress

    if backend == "jax":
        policy = MODELS[model_name][0] if mode == "0" else mode
        tag = f"jax {model_name} mode={mode} batch={batch}"
        say(f"{tag}: building, tracing and running the model")
        fields, text = _jax_worker(cfg, policy, batch, steps)
        say(f"{tag}: {text}")
        harness.write_result(out_path, dict(
            fields, model=model_name, mode=mode, backend="jax", batch=batch,
            recompute=os.environ.get(recompute.ENV_VAR, ""), recompute_enabled=recompute.is_enabled(),
            rss_hwm_bytes=harness.peak_rss_kib() * 1024))
        return

    tag = f"{model_name} mode={mode} batch={batch}"
    say(f"{tag}: building the model")
    step, n_params, make_batches = build(cfg, model_name, mode)
    batches = make_batches(batch, steps + 2)
    t0 = time.process_time()
    step(batches[0])  # trace + first step (creates the buffers)
    say(f"{tag}: traced and ran the first step in "
        f"{time.process_time() - t0:.1f} CPU s; warming up")
    step(batches[1])
    say(f"{tag}: measuring {steps} step(s)")

    # Each measured step: allocator stats reset just before it; its activation
    # memory is the allocator's peak during the step minus what was in use
    # before it. It varies from step to step by a few percent (the executor's
    # op order and the allocator's reuse of free chunks vary): the median is
    # reported, every step's value is in the JSON.
    measured = []
    for i, b in enumerate(batches[2:]):
        if held_log and i == steps - 1:
            held.mark()
        measured.append(harness.allocator_step(lambda: step(b)))
    result = _result(model_name, mode, batch, n_params, measured,
                     recompute=os.environ.get(recompute.ENV_VAR, ""),
                     recompute_enabled=recompute.is_enabled())
    if held_log:
        result["held"] = held.read(held_log)
    say(f"{tag}: {_measured_text(result)}")
    harness.write_result(out_path, result)


def _model(cfg, model_name, mode):
    """`_keras3_model` or `_bert4keras_model` under the policy of `mode` (mode 0: the
    model's first policy, which RECOMPUTE=0 turns off)."""
    policy = MODELS[model_name][0] if mode == "0" else mode
    if model_name == "bert4keras":
        return _bert4keras_model(cfg, policy)
    return _keras3_model(cfg, model_name, policy)


def _result(model_name, mode, batch, n_params, measured, rss_hwm_bytes=None, **fields):
    """A configuration's result from its measured `(loss, activation bytes, CPU s, wall s)`
    steps: the lower medians of the activation memory and of the CPU time (robust to a
    step slowed by other work), every step's values, the first loss. `rss_hwm_bytes`:
    the peak RSS to report, read now when not given."""
    losses, activations, cpu, wall = (list(column) for column in zip(*measured))
    if rss_hwm_bytes is None:
        rss_hwm_bytes = harness.peak_rss_kib() * 1024
    return dict(
        device=harness.measured_device(), malloc=harness.malloc_setting(), model=model_name,
        mode=mode, batch=batch, activation_bytes=int(harness.lower_median(activations)),
        activation_bytes_per_step=[int(a) for a in activations],
        rss_hwm_bytes=rss_hwm_bytes, cpu_s_per_step=harness.lower_median(cpu),
        cpu_s_per_step_each=cpu, wall_s_per_step=sum(wall) / len(wall), loss=losses[0],
        params=n_params, **fields)


def _measured_text(r):
    return (f"activation memory {r['activation_bytes'] / MiB:.1f} MiB (median of steps: "
            f"{', '.join(f'{a / MiB:.1f}' for a in r['activation_bytes_per_step'])}); "
            f"{r['cpu_s_per_step']:.2f} CPU s/step ({r['wall_s_per_step']:.2f} s wall)")


def run_paired_worker(cfg, model_name, modes, batch_sizes, steps, out_path, build=None,
                      progress=None):
    """Every mode at every batch size in this one process (`--paired`): a model per mode,
    its step traced at each batch size under `recompute_scope(mode != "0")`, then a
    warm-up round and `steps` measured rounds of one step per configuration (batch by
    batch, the modes in turn). Writes the results of `run_worker`, one per configuration, with
    `paired=True`: the i-th entries of the configurations' `cpu_s_per_step_each`
    are round i. `build`, `progress`: as for `run_worker`."""
    import recompute

    build, say = build or _model, progress or _progress

    configurations = {}  # (mode, batch) -> (step, its batches)
    params = {}
    for mode in modes:
        say(f"{model_name} mode={mode}: building the model and tracing its step "
            f"at batch {', '.join(map(str, batch_sizes))}")
        step, params[mode], make_batches = build(cfg, model_name, mode)
        for batch in batch_sizes:
            batches = make_batches(batch, steps + 2)
            with recompute.recompute_scope(mode != "0"):  # baked into the traced step
                step(batches[0])
            configurations[mode, batch] = (step, batches[1:])

    def run_round(i):
        """One step of each configuration on its i-th batch, batch by batch, the modes in
        turn: {(mode, batch): what `harness.allocator_step` returns}."""
        out = {}
        for batch in batch_sizes:
            for mode in modes:
                step, batches = configurations[mode, batch]
                with recompute.recompute_scope(mode != "0"):
                    out[mode, batch] = harness.allocator_step(lambda: step(batches[i]))
        return out

    # A warm-up round in the measured order first: the first step of a configuration
    # after the others have run has measured several times the next one's CPU time.
    run_round(0)
    say(f"warm-up round done; measuring {steps} round(s)")
    measured = {key: [] for key in configurations}
    for i in range(1, steps + 1):
        for key, step_figures in run_round(i).items():
            measured[key].append(step_figures)
        say(f"round {i} of {steps}: CPU s/step " + "; ".join(
            f"batch {b}: " + ", ".join(f"{m} {measured[m, b][-1][2]:.2f}" for m in modes)
            for b in batch_sizes))
    # The process's peak RSS, read once: building the results allocates, and a peak read
    # per result could differ by a page.
    process_hwm = harness.peak_rss_kib() * 1024
    results = [_result(model_name, mode, batch, params[mode], measured[mode, batch],
                       rss_hwm_bytes=process_hwm, recompute="scope",
                       recompute_enabled=mode != "0", paired=True)
               for (mode, batch) in configurations]
    for r in results:
        say(f"{model_name} mode={r['mode']} batch={r['batch']}: {_measured_text(r)}")
    harness.write_result(out_path, dict(runs=results))


# --------------------------------------------------------------------------
# Parent: spawn the workers, summarise.


def _settings(core, batch_cut):
    """The worker's options for the library's settings: the attention core, the cut."""
    return ["--core", core] + ([] if batch_cut is None else ["--batch-cut", str(batch_cut)])


def _spawn(cfg, model_name, mode, batch, steps, backend="tensorflow", malloc="default",
           core="auto", batch_cut=None, log_held=False):
    _progress(f"{model_name} mode={mode} batch={batch}: starting a fresh worker process"
              + (" (logging every allocation: slower)" if log_held else ""))
    return _run_worker(cfg, model_name, ["--modes", mode, "--batch-sizes", str(batch)]
                       + _settings(core, batch_cut) + (["--held"] if log_held else []), steps,
                       "0" if mode == "0" else "1", backend, malloc,
                       f"benchmark worker {model_name} mode={mode} batch={batch}",
                       held.ENV if log_held else None)


def _spawn_paired(cfg, model_name, modes, batch_sizes, steps, malloc="default", core="auto",
                  batch_cut=None):
    _progress(f"{model_name}: modes {', '.join(modes)} at batch {', '.join(map(str, batch_sizes))} "
              f"in one fresh worker process, {steps} rounds")
    return _run_worker(cfg, model_name, ["--modes", ",".join(modes), "--paired", "--batch-sizes",
                                         ",".join(map(str, batch_sizes))]
                       + _settings(core, batch_cut),
                       steps, None, "tensorflow", malloc,
                       f"paired benchmark worker {model_name}")["runs"]


def _run_worker(cfg, model_name, configuration, steps, recompute, backend, malloc, what,
                extra_env=None):
    """Runs one worker for `configuration` (its command-line options) with this run's
    model, shape and steps, `RECOMPUTE=recompute` (None: unset), the allocator
    statistics, `--malloc`, `extra_env` and, for bert4keras, tf_keras; returns its result."""
    env = dict(harness.allocator_env(), RECOMPUTE=recompute, KERAS_BACKEND=backend,
               **harness.malloc_env(malloc), **(extra_env or {}))
    if model_name == "bert4keras":
        env.update(TF_KERAS="1", TF_USE_LEGACY_KERAS="1")
    runs = harness.run_workers(
        _progress, ["--model", model_name, *configuration, "--steps", str(steps),
                    "--backend", backend, *encoder.shape_argv(cfg)], [env])
    return harness.require_results(runs, what)[0]


def summarize(runs, modes, batch_sizes):
    """Per mode: the per-sample slope and fixed part; per mode other than 0, its ratios to 0.

    The CPU time ratio at a batch size is that of the configurations' median steps;
    for runs of one process (`--paired`) it is the median of the rounds' ratios
    (`cpu_time_round_ratios`: a round's steps ran under the same load), and the
    peak RSS, the process's, has no slope.
    """
    paired = runs[0].get("paired", False)
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        slope, intercept = harness.slope([(r["batch"], r["activation_bytes"]) for r in mine])
        rss_slope = None if paired else harness.slope([(r["batch"], r["rss_hwm_bytes"]) for r in mine])[0]
        summary[mode] = dict(
            per_sample_bytes=slope, fixed_bytes=intercept, rss_per_sample_bytes=rss_slope,
            cpu_s_per_step={str(r["batch"]): r["cpu_s_per_step"] for r in mine},
        )
    by_key = {(r["mode"], r["batch"]): r for r in runs}
    ratios = {}
    off = summary.get("0")
    for mode, on in summary.items():
        if mode == "0" or off is None:
            continue
        ratios[mode] = dict(
            memory_per_sample_off_over_on=_ratio(off["per_sample_bytes"], on["per_sample_bytes"]),
            rss_per_sample_off_over_on=(None if paired else
                                        _ratio(off["rss_per_sample_bytes"], on["rss_per_sample_bytes"])),
        )
        if paired:
            rounds = {str(b): [x / y for x, y in zip(by_key[mode, b]["cpu_s_per_step_each"],
                                                   by_key["0", b]["cpu_s_per_step_each"])]
                      for b in batch_sizes}
            ratios[mode].update(cpu_time_on_over_off={b: harness.lower_median(r) for b, r in rounds.items()},
                                cpu_time_round_ratios=rounds)
        else:
            ratios[mode]["cpu_time_on_over_off"] = {
                str(b): on["cpu_s_per_step"][str(b)] / off["cpu_s_per_step"][str(b)] for b in batch_sizes}
    return summary, ratios


def _ratio(off, on):
    return off / on if on > 0 else float("inf")


def print_report(cfg, runs, summary, ratios, out=None):
    out = sys.stdout if out is None else out  # the current one: report_to_docs redirects it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    jax = runs[0].get("backend") == "jax"
    paired = runs[0].get("paired", False)
    measure = ("JAX's saved residuals (weights included), XLA's compiled temp buffer, "
               "the jitted value_and_grad step" if jax else f"allocator of {runs[0].get('device', 'CPU:0')}")
    how = ("; every configuration in one process, a measured step of each in turn per round "
           f"(--paired, {len(runs[0]['cpu_s_per_step_each'])} rounds)" if paired else "")
    p(f"recompute benchmark: {runs[0]['model']} model, {cfg['layers']} blocks, hidden "
      f"{cfg['hidden']}, {cfg['heads']} heads, FFN {cfg['ffn']}, seq {cfg['seq']}, vocab "
      f"{cfg['vocab']}, dropout {cfg['dropout']}, {'no optimizer' if jax else 'Adam'}; "
      f"{runs[0]['params'] / 1e6:.1f}M parameters; {'Keras 3 on JAX, ' if jax else ''}{measure}"
      f"; CPU allocation: {runs[0].get('malloc', 'default')} (--malloc){how}")
    p("")
    label = "residuals MiB" if jax else "activation MiB"
    extra = f" {'XLA temp MiB':>13}" if jax else ""
    p(f"{'mode':>9} {'batch':>5} {label:>15}{extra} {'peak RSS MiB':>13} "
      f"{'CPU s/step':>11} {'loss':>8}")
    for r in runs:
        extra = f" {r['xla_temp_bytes'] / MiB:>13.1f}" if jax else ""
        rss = "(process)" if paired else f"{r['rss_hwm_bytes'] / MiB:.1f}"
        p(f"{r['mode']:>9} {r['batch']:>5} {r['activation_bytes'] / MiB:>15.1f}{extra} "
          f"{rss:>13} {r['cpu_s_per_step']:>11.2f} {r['loss']:>8.4f}")
    if paired:
        p(f"peak RSS of the process (every configuration): {runs[0]['rss_hwm_bytes'] / MiB:.1f} MiB; "
          "activation memory in one process reads higher than in fresh processes: "
          "take it from a run without --paired")
    p("")
    times = "CPU time mode/0: median of the rounds (each round)" if paired else "CPU time mode/0"
    p(f"{'mode':>9} {'MiB/sample':>11} {'fixed MiB':>10} {'RSS MiB/sample':>15} "
      f"{'memory 0/mode':>14} {'RSS 0/mode':>11}  {times}")
    for mode, s in summary.items():
        r = ratios.get(mode)
        mem = f"x{r['memory_per_sample_off_over_on']:.2f}" if r else "-"
        rss = f"x{r['rss_per_sample_off_over_on']:.2f}" if r and not paired else "-"
        rss_slope = "-" if paired else f"{s['rss_per_sample_bytes'] / MiB:.1f}"
        if not r:
            times = "-"
        elif paired:
            times = ", ".join(
                f"batch {b}: x{v:.3f} ({' '.join(f'{x:.3f}' for x in r['cpu_time_round_ratios'][b])})"
                for b, v in r["cpu_time_on_over_off"].items())
        else:
            times = ", ".join(f"batch {b}: x{v:.3f}" for b, v in r["cpu_time_on_over_off"].items())
        p(f"{mode:>9} {s['per_sample_bytes'] / MiB:>11.1f} {s['fixed_bytes'] / MiB:>10.1f} "
          f"{rss_slope:>15} {mem:>14} {rss:>11}  {times}")


# --------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
    parser = harness.parser(
        "benchmarks.recompute_memory",
        "Activation memory and CPU time of a BERT-base-shaped encoder trained without "
        "recomputation (mode 0) and with each recomputation policy (each configuration "
        "in a fresh subprocess).",
    )
    encoder.add_shape_arguments(
        parser, FULL, steps_help="timed steps after warm-up",
        batch_help="comma-separated batch sizes; the per-sample memory is the "
                   "slope between them (default 2,6)")
    parser.add_argument("--model", choices=tuple(MODELS),
                        help="lean (default) or standard Keras 3 encoder, or bert4keras's BERT; "
                             "--backend jax: standard only (its default)")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow",
                        help="Keras 3 backend of the lean and standard encoders (default "
                             "tensorflow); jax measures JAX's saved residuals and XLA's temp buffer")
    parser.add_argument("--modes", help="comma-separated: 0 (RECOMPUTE=0) and policies of the "
                                        "model (lean: full; standard: full, attention; bert4keras: "
                                        "layer, block, attention, block_keep_ffn); 1 = the first policy "
                                        "(default: 0 and every policy)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shape (3 blocks, hidden 256, seq 128): about 30 s; "
                             "explicit options still override it")
    parser.add_argument("--paired", action="store_true",
                        help="measure every configuration in one process, a step of each in "
                             "turn for --steps rounds: the CPU time ratios are the medians "
                             "of the rounds' ratios (TensorFlow backend)")
    parser.add_argument("--core", choices=("auto", "blocked", "keras"), default="auto",
                        help="the attention core (`recompute.attention_core`) in every worker: "
                             "auto (default, the library's rule), blocked, or keras (the "
                             "layer's own)")
    parser.add_argument("--batch-cut", type=harness.non_negative_int, default=None,
                        metavar="SAMPLES",
                        help="samples per cut where a recomputed Keras 3 block runs its batch "
                             "in cuts under \"full\" (`recompute.batch_cut`; default: the "
                             "library's rule; 0: whole batches)")
    parser.add_argument("--held", action="store_true",
                        help="also print what the last measured step holds at its peak, from "
                             "TensorFlow's allocation log, grouped by the op that made each "
                             "tensor, with each group's MiB per sample (benchmarks.held; "
                             "TensorFlow, fresh processes; the steps run slower)")
    harness.add_output_arguments(parser, TOOL, malloc=True)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)
    if args.held and (args.paired or args.backend == "jax"):
        parser.error("--held reads TensorFlow's allocation log in fresh processes: it takes "
                     "--backend tensorflow without --paired; got "
                     + ("--paired" if args.paired else "--backend jax"))

    if args.model is None:
        args.model = "standard" if args.backend == "jax" else "lean"
    if args.backend == "jax" and args.model != "standard":
        parser.error(f"--backend jax measures the standard Keras 3 encoder (--model standard); "
                     f"got --model {args.model}")
    if args.backend == "jax" and args.paired:
        parser.error("--paired measures TensorFlow's allocator and steps: it takes --backend "
                     "tensorflow; got --backend jax")
    encoder.finish_shape_arguments(parser, args, QUICK if args.quick else FULL,
                                   need_slope=not args.worker)
    policies = MODELS[args.model]
    known = ("0",) + policies
    if args.modes is None:
        args.modes = known
    else:
        modes = [policies[0] if m == "1" else m for m in args.modes.split(",")]
        if not modes or any(m not in known for m in modes) or len(set(modes)) != len(modes):
            parser.error(f"--modes: expected distinct items of {', '.join(known)} (or 1) for "
                         f"--model {args.model}, got {args.modes!r}")
        args.modes = tuple(modes)
    if args.worker and (not args.out or (len(args.batch_sizes) != 1 and not args.paired)):
        parser.error("--worker needs --out and exactly one batch size (or --paired)")
    harness.check_json_folder(parser, args)
    return args


def main(argv=None):
    try:
        return _main(argv)
    except RuntimeError as e:  # a worker failed: its stderr tail is printed already
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(argv=None):
    args = parse_args(argv)
    cfg = encoder.shape_config(args)
    batch_sizes = sorted(args.batch_sizes)
    held_log = args.out + ".log" if args.worker and args.held else None
    if held_log:
        held.capture(held_log)  # before TensorFlow is imported
    if args.worker:
        import recompute

        recompute.attention_core(args.core)  # read when a core is traced
        recompute.batch_cut(args.batch_cut)  # read when a block is traced
    if args.worker and args.paired:
        run_paired_worker(cfg, args.model, args.modes, batch_sizes, args.steps, args.out)
        return 0
    if args.worker:
        run_worker(cfg, args.model, args.modes[0], args.batch_sizes[0], args.steps, args.out,
                   args.backend, held_log=held_log)
        return 0

    start = time.perf_counter()
    if args.paired:
        runs = _spawn_paired(cfg, args.model, args.modes, batch_sizes, args.steps, args.malloc,
                             args.core, args.batch_cut)
    else:
        # Interleaved (off, on at each batch size) so that a change in the load of
        # the machine during the run does not bias the time ratio.
        runs = [_spawn(cfg, args.model, mode, batch, args.steps, args.backend, args.malloc,
                       args.core, args.batch_cut, args.held)
                for batch in batch_sizes for mode in args.modes]
    runs.sort(key=lambda r: (args.modes.index(r["mode"]), r["batch"]))
    summary, ratios = summarize(runs, args.modes, batch_sizes)
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    with harness.report_to_docs(args.docs, TOOL, argv):
        if args.core != "auto":
            print(f"attention core: {args.core} (recompute.attention_core({args.core!r}))")
        if args.batch_cut is not None:
            print(f"batch cut: {args.batch_cut} (recompute.batch_cut({args.batch_cut}))")
        print_report(cfg, runs, summary, ratios)
        if args.held:
            held.print_report({m: {r["batch"]: r["held"] for r in runs if r["mode"] == m}
                               for m in args.modes}, batch_sizes, sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=dict(cfg, model=args.model, backend=args.backend, batch_sizes=batch_sizes,
                                       steps=args.steps, malloc=args.malloc, paired=args.paired,
                                       core=args.core, batch_cut=args.batch_cut, held=args.held),
                           runs=runs, summary=summary, ratios=ratios), f, indent=2)
        _progress(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
