"""Activation memory and time of keras-hub causal-LM decoders at real widths, LoRA on, per policy.

    python -m benchmarks.lm_memory                                  # Gemma-2B widths, seq 1024, 2048
    python -m benchmarks.lm_memory --seqs 1024,2048,4096 --plot docs/keras_hub_memory.png \\
        --docs docs/keras_hub.md
    python -m benchmarks.lm_memory --paired --seqs 2048 --layers 2 --batch-sizes 1 --steps 3
    python -m benchmarks.lm_memory --model gemma-7b --seqs 1024,2048 --modes 0,full \\
        --predict-seq 8192                                          # the 24 GiB GPU question
    python -m benchmarks.lm_memory --model tiny --seqs 64 --steps 1  # seconds, for CI

The model (`--model`) is a randomly initialized keras-hub `CausalLM` with the
widths of a real one (`MODELS`: Gemma-2B's `GemmaBackbone`, Gemma-7B's, a
Llama-2-7B `LlamaBackbone`), but few decoder blocks (`--layers`, default 1
and 2) and a small vocabulary (`--vocab`, default 1000: the embedding and
the logits are not the block, and at 256000 tokens they alone would not fit
on this machine); `backbone.enable_lora(--rank)` before the step is traced,
so only the LoRA factors train (Adam), dropout `--dropout` (default 0, as
Gemma's presets). Modes (`--modes`): `0` is RECOMPUTE=0; `full` and
`attention` are `recompute.keras_hub.patch(policy=...)` with RECOMPUTE=1 in
the worker's environment (mode 0 patches "full" and turns it off).

Every configuration (sequence length, block count, batch size, mode) runs in
a fresh worker process (`benchmarks.recompute_memory.run_worker` with this
tool's model: TensorFlow's allocator peak of a step above what was alive,
the median over `--steps` steps after a traced and a warm-up step; CPU
seconds per step). Per sequence length and mode:

- per sample: the slope of the activation memory between the batch sizes,
  at each block count;
- kept per block: the slope of that per-sample figure between the block
  counts (what each more block keeps for the backward pass), and its
  intercept, the per-sample memory that does not grow with the blocks (one
  block's recomputation working set, the embedding and logits);
- projected to the real model's block count N (`MODELS`): N x kept per
  block + intercept, per sample, and so how many samples (tokens: batch x
  seq) fit in a budget of activation memory (`--budget-gib`), and the
  longest sequence that fits at batch 1. Projections, not measurements: the
  real model was not run.

A configuration whose worker passes `--rss-limit-gib` of resident memory is
stopped and reported as failed (the longest sequence that trains on this
machine); the larger ones of that sequence length and mode are skipped.

`--paired` measures the time ratio instead: every mode in one worker process
at one sequence length and block count (`recompute_memory.run_paired_worker`),
a step of each in turn per round; the ratio is the median of the rounds'
(the cores may be shared with other work). `--predict-seq S` adds the
prediction for the real model at seq S, batch 1, bfloat16 (half the float32
bytes measured here): weights + N x S x kept per block per token. `--plot`
draws kept per block and the projection against the sequence length.
Limits: CPU, TensorFlow backend, float32; no flash attention on TensorFlow
(keras-hub's own attention: the [seq, seq] scores are materialized).
"""

import json
import os
import sys
import time

from . import harness, recompute_memory
from .harness import GiB, MiB

TOOL = "benchmarks.lm_memory"
MODES = ("0", "attention", "full")
# Widths of the real models (keras-hub's backbone arguments); `blocks`, `vocab`: the real
# model's decoder blocks and vocabulary, for the projections. Gemma's `intermediate` is
# keras-hub's `intermediate_dim`, which its blocks halve (each gate: 16384 for 2B, 24576 for 7B).
MODELS = {
    "gemma-2b": dict(kind="gemma", hidden=2048, heads=8, kv_heads=1, head_dim=256,
                     intermediate=32768, blocks=18, vocab=256000),
    "gemma-7b": dict(kind="gemma", hidden=3072, heads=16, kv_heads=16, head_dim=256,
                     intermediate=49152, blocks=28, vocab=256000),
    "llama-7b": dict(kind="llama", hidden=4096, heads=32, kv_heads=32, head_dim=128,
                     intermediate=11008, blocks=32, vocab=32000),
    "tiny": dict(kind="gemma", hidden=64, heads=2, kv_heads=1, head_dim=32,
                 intermediate=256, blocks=4, vocab=1000),
}
_progress = harness.Progress(TOOL)


# --------------------------------------------------------------------------
# Worker: the model.


def causal_lm(cfg, model_name, mode, abstract=False):
    """(the LoRA causal LM `model_name` with `cfg["layers"]` blocks, patched with the policy of
    `mode` ("full" for mode 0), its parameter count before LoRA). `abstract`: the backbone's
    weights are made in a `keras.StatelessScope(initialize_variables=False)`, shapes without
    values (for a compiler's plan; tracing must then run in such a scope too)."""
    import contextlib
    import recompute.keras_hub

    recompute.keras_hub.patch(policy="full" if mode == "0" else mode)
    import keras
    import keras_hub

    shape = MODELS[model_name]
    keras.utils.set_random_seed(0)
    common = dict(vocabulary_size=cfg["vocab"], num_layers=cfg["layers"],
                  num_query_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  hidden_dim=shape["hidden"], intermediate_dim=shape["intermediate"],
                  dropout=cfg["dropout"])
    scope = (keras.StatelessScope(initialize_variables=False) if abstract
             else contextlib.nullcontext())
    with scope:
        if shape["kind"] == "gemma":
            backbone = keras_hub.models.GemmaBackbone(head_dim=shape["head_dim"], **common)
        else:
            backbone = keras_hub.models.LlamaBackbone(**common)
    if shape["kind"] == "gemma":
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    n_params = int(lm.count_params())  # before LoRA: the model's own weights
    backbone.enable_lora(cfg["rank"])
    if len(recompute.keras_hub.covered(lm)) != cfg["layers"]:
        raise RuntimeError(f"{model_name}: not every block is covered by the patch")
    return lm, n_params


def build(cfg, model_name, mode):
    """(step of a batch -> loss, parameter count, batches) of `causal_lm` on TensorFlow, Adam
    over the LoRA factors: the interface of `recompute_memory._model`."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    lm, n_params = causal_lm(cfg, model_name, mode)
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(lm.trainable_variables)

    @tf.function
    def train_step(ids):
        x = {"token_ids": ids[:, :-1], "padding_mask": tf.ones_like(ids[:, :-1], tf.bool)}
        with tf.GradientTape() as tape:
            logits = lm(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                ids[:, 1:], logits, from_logits=True))
        grads = tape.gradient(loss, lm.trainable_variables)
        optimizer.apply_gradients(zip(grads, lm.trainable_variables))
        return loss

    def batches(batch, n):
        rng = tf.random.Generator.from_seed(batch)
        return [rng.uniform([batch, cfg["seq"] + 1], 0, cfg["vocab"], dtype=tf.int32)
                for _ in range(n)]

    return (lambda ids: float(train_step(ids).numpy())), n_params, batches


def jax_batch(batch, seq, vocab, seed):
    """Random next-token data for a causal LM on JAX: (inputs, targets) of `batch` x `seq`
    token ids drawn with NumPy's generator of `seed`, no padding."""
    import numpy as np

    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)).astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones((batch, seq), bool)}, ids[:, 1:]


def jax_loss(lm, trainable, non_trainable, x, y):
    """`lm`'s mean next-token cross-entropy on (`x`, `y`) through `stateless_call` (Keras 3
    on JAX), and its non-trainable state after the call."""
    import keras

    logits, non_trainable = lm.stateless_call(trainable, non_trainable, x, training=True)
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    return loss, non_trainable


def jax_residuals(args, seq, out_path):
    """Keras 3 on JAX: the bytes JAX keeps for the backward pass of the loss over the LoRA
    factors (`recompute_memory.saved_residual_bytes`: shapes only, nothing allocated), every
    mode, block count and batch size at `seq` in this one process (RECOMPUTE by
    `recompute_scope` while tracing). The frozen weights among them cancel in the slopes."""
    from recompute import recompute_scope

    runs = []
    for mode in args.modes:
        for layers in args.layers:
            lm, n_params = causal_lm(_cfg(args, layers, seq), args.model, mode)
            trainable = [v.value for v in lm.trainable_variables]
            non_trainable = [v.value for v in lm.non_trainable_variables]
            for batch in args.batch_sizes:
                x, y = jax_batch(batch, seq, args.vocab, batch)

                def loss(t):
                    return jax_loss(lm, t, non_trainable, x, y)[0]

                with recompute_scope(mode != "0"):
                    kept = recompute_memory.saved_residual_bytes(loss, trainable)
                runs.append(dict(mode=mode, layers=layers, batch=batch, activation_bytes=kept,
                                 params=n_params, cpu_s_per_step=None))
                _progress(f"jax seq {seq}, {layers} block(s), batch {batch}, mode {mode}: "
                          f"saved residuals {kept / MiB:.1f} MiB")
    harness.write_result(out_path, dict(runs=runs))


# --------------------------------------------------------------------------
# Parent: the runs.


def _cfg(args, layers, seq):
    return dict(layers=layers, seq=seq, vocab=args.vocab, rank=args.rank, dropout=args.dropout)


def _run(args, configuration, recompute, what, timeout=None):
    """One worker (`configuration`: its options); its result, or {"failed": why, ...} where
    it failed (out of memory: stopped past --rss-limit-gib)."""
    env = dict(harness.allocator_env(), RECOMPUTE=recompute, KERAS_BACKEND=args.backend)
    argv = ["--model", args.model, "--backend", args.backend, "--vocab", str(args.vocab),
            "--rank", str(args.rank),
            "--dropout", str(args.dropout), "--steps", str(args.steps), *configuration]
    run, = harness.run_workers(_progress, argv, [env], timeout=timeout,
                               rss_abort_bytes=args.rss_limit_gib * GiB)
    if run.result is None:
        sys.stderr.write(run.tail[-2000:])
        _progress(f"{what}: {run.failure(timeout)}; peak RSS {run.peak_rss_kib / 1024:.0f} MiB")
        return dict(failed=run.failure(timeout), peak_rss_bytes=run.peak_rss_kib * 1024)
    return run.result


def sweep(args):
    """{seq: {mode: {(layers, batch): result}}}, every configuration in a fresh process;
    after a failure the larger configurations of that seq and mode are not run."""
    results = {}
    for seq in args.seqs:
        results[seq] = {mode: {} for mode in args.modes}
        if args.backend == "jax":
            done = _run(args, ["--seqs", str(seq), "--modes", ",".join(args.modes), "--layers",
                               ",".join(map(str, args.layers)), "--batch-sizes",
                               ",".join(map(str, args.batch_sizes))], None, f"jax seq {seq}")
            for r in done.get("runs", []):
                results[seq][r["mode"]][r["layers"], r["batch"]] = r
            for mode in args.modes:  # a failed worker: every configuration of this seq failed
                results[seq][mode] = results[seq][mode] or {
                    (n, b): done for n in args.layers for b in args.batch_sizes}
            continue
        for layers in args.layers:
            for batch in args.batch_sizes:
                for mode in args.modes:  # interleaved: a change of load biases no mode
                    mine = results[seq][mode]
                    if any("failed" in r for r in mine.values()):
                        mine[layers, batch] = dict(failed="skipped: a smaller one failed")
                        continue
                    what = f"seq {seq}, {layers} block(s), batch {batch}, mode {mode}"
                    _progress(f"{what}: starting a fresh worker process")
                    mine[layers, batch] = _run(
                        args, ["--seqs", str(seq), "--layers", str(layers), "--modes", mode,
                               "--batch-sizes", str(batch)], "0" if mode == "0" else "1", what)
    return results


def fit(runs, model):
    """What one seq and mode's runs {(layers, batch): result} give: per-sample MiB at each
    block count, kept MiB per block per sample (slope over the block counts), the
    intercept, the projection to the real model's blocks; None where runs failed."""
    ok = {key: r for key, r in runs.items() if "failed" not in r}
    per_sample = {}
    for layers in sorted({layers for layers, _ in runs}):
        points = [(b, r["activation_bytes"] / MiB) for (n, b), r in ok.items() if n == layers]
        if len(points) == len([1 for n, _ in runs if n == layers]) and len(points) >= 2:
            per_sample[layers] = harness.slope(points)[0]
    out = dict(per_sample=per_sample, kept=None, once=None, projected=None)
    if len(per_sample) >= 2:
        out["kept"], out["once"] = harness.slope(sorted(per_sample.items()))
        out["projected"] = MODELS[model]["blocks"] * out["kept"] + out["once"]
    return out


def largest(runs):
    """The run at the most blocks and the largest batch, if it ran."""
    key = max(runs)
    return None if "failed" in runs[key] else runs[key]


def budget_rows(seqs, fits, modes, budget_gib):
    """Per seq and mode: samples of the projected model that fit in `budget_gib` of activations,
    and tokens (samples x seq)."""
    rows = {}
    for seq in seqs:
        for mode in modes:
            projected = fits[seq][mode]["projected"]
            samples = None if projected is None else int(budget_gib * 1024 // projected)
            rows[seq, mode] = (samples, None if samples is None else samples * seq)
    return rows


def block_params(results):
    """Weights per block (float32 count), from the model's parameter counts at two block counts."""
    counts = {}
    for by_mode in results.values():
        for runs in by_mode.values():
            for (layers, _), r in runs.items():
                if "params" in r:
                    counts[layers] = r["params"]
    if len(counts) < 2:
        return None, None
    per_block, rest = harness.slope(sorted(counts.items()))
    return per_block, rest


def print_report(args, results, fits):
    shape = MODELS[args.model]
    p = print
    p(f"keras-hub {args.model}-shaped CausalLM ({shape['kind']}: hidden {shape['hidden']}, "
      f"{shape['heads']} query / {shape['kv_heads']} key-value heads of {shape['head_dim']}, "
      f"intermediate_dim {shape['intermediate']}), {' and '.join(map(str, args.layers))} "
      f"block(s), vocab {args.vocab} (the real one has {shape['vocab']}: embedding and logits are "
      f"not the block), LoRA rank {args.rank}, dropout {args.dropout:g}; float32; " + (
          "Keras 3 on JAX, JAX's saved residuals of the loss (jax.vjp, shapes only), every "
          "configuration of a seq in one process, RECOMPUTE by recompute_scope" if args.backend == "jax"
          else "TensorFlow, its CPU allocator's peak of an Adam step, every configuration in a fresh "
               "process, mode 0 = RECOMPUTE=0, else patch(policy) + RECOMPUTE=1")
      + f"; batches {','.join(map(str, args.batch_sizes))}")
    _print_measured(args, results, fits)
    _print_failures(args, results)
    _print_budget(args, fits)
    if args.predict_seq:
        print_prediction(args, results, fits)


def _print_measured(args, results, fits):
    """The table of what was measured: a row per seq and mode."""
    n = MODELS[args.model]["blocks"]
    p = print
    p("")
    top = max(args.layers)
    p(f"{'seq':>5} {'mode':>9} " + " ".join(f"{f'MiB/sample {n_}bl':>15}" for n_ in args.layers)
      + f" {'kept MiB/block':>14} {'once MiB':>9} {f'{n} blocks MiB':>13} {'0/mode':>7}"
      f" {f'CPU s/step {top}bl':>15} {'mode/0':>7}")
    for seq in args.seqs:
        off = fits[seq].get("0")
        off_run = largest(results[seq]["0"]) if "0" in results[seq] else None
        for mode in args.modes:
            f, runs = fits[seq][mode], results[seq][mode]
            cells = [f"{f['per_sample'][n_]:>15.1f}" if n_ in f["per_sample"] else f"{'failed':>15}"
                     for n_ in args.layers]
            kept = f"{f['kept']:>14.1f}" if f["kept"] is not None else f"{'-':>14}"
            once = f"{f['once']:>9.1f}" if f["once"] is not None else f"{'-':>9}"
            proj = f"{f['projected']:>13.0f}" if f["projected"] is not None else f"{'-':>13}"
            ratio = (f"x{off['projected'] / f['projected']:.1f}" if mode != "0" and off and
                     off["projected"] and f["projected"] else "-")
            run = largest(runs)
            run = run if run and run["cpu_s_per_step"] else None
            cpu = f"{run['cpu_s_per_step']:>15.2f}" if run else f"{'-':>15}"
            slower = (f"x{run['cpu_s_per_step'] / off_run['cpu_s_per_step']:.2f}"
                      if run and off_run and mode != "0" else "-")
            p(f"{seq:>5} {mode:>9} {' '.join(cells)} {kept} {once} {proj} {ratio:>7} {cpu} {slower:>7}")


def _print_failures(args, results):
    """The configurations that failed (not those skipped after one)."""
    p = print
    failed = [(seq, mode, key, r) for seq in args.seqs for mode in args.modes
              for key, r in results[seq][mode].items() if "failed" in r]
    for seq, mode, (layers, batch), r in failed:
        if not r["failed"].startswith("skipped"):
            p(f"seq {seq}, mode {mode}, {layers} block(s), batch {batch}: {r['failed']} "
              f"(resident memory limit {args.rss_limit_gib:g} GiB; peak "
              f"{r['peak_rss_bytes'] / GiB:.1f} GiB); larger ones not run")


def _print_budget(args, fits):
    """The projection for the real model's blocks: what fits in `--budget-gib`."""
    n = MODELS[args.model]["blocks"]
    p = print
    p("")
    p(f"Projected (not measured) for the real {n} blocks: per sample = {n} x kept + once. "
      f"In a budget of {args.budget_gib:g} GiB of activation memory (weights not counted):")
    rows = budget_rows(args.seqs, fits, args.modes, args.budget_gib)
    p(f"{'seq':>5} " + " ".join(f"{m + ' samples':>17} {'tokens':>7}" for m in args.modes)
      + (" tokens full/0" if {"0", "full"} <= set(args.modes) else ""))
    for seq in args.seqs:
        cells = []
        for mode in args.modes:
            samples, tokens = rows[seq, mode]
            cells.append(f"{'-' if samples is None else samples:>17} {'-' if tokens is None else tokens:>7}")
        extra = ""
        if {"0", "full"} <= set(args.modes):
            off, on = rows[seq, "0"][1], rows[seq, "full"][1]
            extra = (f" {'-':>13}" if off is None or on is None else
                     f" {'inf' if off == 0 and on else f'x{on / off:.1f}' if off else '-':>13}")
        p(f"{seq:>5} " + " ".join(cells) + extra)
    for mode in args.modes:
        fitting = [seq for seq in args.seqs if (rows[seq, mode][0] or 0) >= 1]
        p(f"longest measured seq that fits at batch 1 in {args.budget_gib:g} GiB, mode {mode}: "
          f"{max(fitting) if fitting else 'none'}")


def print_prediction(args, results, fits):
    """The real model at `--predict-seq`, batch 1, bfloat16: weights + blocks x seq x kept per token."""
    shape, seq = MODELS[args.model], args.predict_seq
    per_block, rest = block_params(results)
    p = print
    p("")
    if per_block is None:
        p("prediction: needs two block counts")
        return
    embedding = shape["vocab"] * shape["hidden"]
    weights = (shape["blocks"] * per_block + (rest - args.vocab * shape["hidden"]) + embedding) * 2
    p(f"Prediction (not a measurement) for the real {args.model}: {shape['blocks']} blocks, seq "
      f"{seq}, batch 1, bfloat16 (half of the float32 bytes measured): weights "
      f"{weights / GiB:.1f} GiB ({per_block / 1e6:.0f}M per block, embedding "
      f"{embedding / 1e6:.0f}M; LoRA factors and their Adam state negligible)")
    for mode in args.modes:
        points = [(s, fits[s][mode]["kept"] / s) for s in args.seqs if fits[s][mode]["kept"] is not None]
        if not points:
            continue
        # Kept per block per token: constant for "full" (the block's input); for the others it
        # grows with seq where [seq, seq] tensors are kept: extrapolated linearly in seq
        # unless measured at `seq`.
        slope_, icpt = harness.slope(points) if len(points) >= 2 else (0.0, points[0][1])
        per_token = dict(points).get(seq, max(icpt + slope_ * seq, 0.0))
        kept = shape["blocks"] * seq * per_token * MiB / 2
        once = fits[seq][mode]["once"] if seq in fits else None
        p(f"  mode {mode}: kept per block per token {per_token * 1024:.1f} KiB float32 at seq "
          f"{seq} ({'measured' if seq in dict(points) else 'extrapolated'}; at "
          f"{', '.join(f'{s}: {v * 1024:.1f}' for s, v in points)}); {shape['blocks']} x {seq} x "
          f"that / 2 = {kept / GiB:.2f} GiB; weights + kept = {(weights + kept) / GiB:.1f} GiB"
          + ("" if once is None else f"; + once per sample / 2 = {(weights + kept) / GiB + once / 2048:.1f} GiB"))
    # JAX's saved residuals hold no transient buffer: there "once" lacks the working set of the
    # block being recomputed: about what that block keeps without recomputation (its recomputed
    # activations), plus the backward pass's temporaries.
    where = ("never in 'once' on JAX" if args.backend == "jax" else
             "in 'once' where measured at this seq")
    off = fits.get(seq, {}).get("0", {}).get("kept") if args.backend == "jax" else None
    if off is not None:
        where += (f"; about mode 0's kept per block at seq {seq} / 2 = {off / 2048:.1f} GiB "
                  "per sample, plus the backward's temporaries")
    p(f"  not counted: the working set of the one block being recomputed or differentiated "
      f"({where}), and the "
      f"logits of the {shape['vocab']}-token vocabulary ({seq} x {shape['vocab']} x 4 bytes = "
      f"{seq * shape['vocab'] * 4 / GiB:.1f} GiB in float32 unless the loss is chunked)")


def paired(args):
    """Every mode in one worker process at one seq and block count: the time ratios."""
    seq, layers = args.seqs[0], args.layers[0]
    _progress(f"seq {seq}, {layers} block(s): modes {', '.join(args.modes)} at batch "
              f"{', '.join(map(str, args.batch_sizes))} in one fresh worker process, {args.steps} rounds")
    result = _run(args, ["--seqs", str(seq), "--layers", str(layers), "--modes", ",".join(args.modes),
                         "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--paired"],
                  None, "paired worker")
    if "failed" in result:
        raise RuntimeError(f"the paired worker {result['failed']}")
    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    shape = MODELS[args.model]
    print(f"keras-hub {args.model}-shaped CausalLM, {layers} block(s), seq {seq}, vocab {args.vocab}, "
          f"LoRA rank {args.rank} (Adam), dropout {args.dropout:g} (hidden {shape['hidden']}, "
          f"intermediate_dim {shape['intermediate']}); TensorFlow, float32; every mode in one "
          f"process, a step of each in turn per round ({args.steps} rounds after a warm-up round): "
          "CPU seconds per step (median), per 1000 tokens, and mode/0, the median of the rounds' "
          "ratios (each round's in brackets)")
    print("")
    for batch in args.batch_sizes:
        for mode in args.modes:
            r = runs[mode, batch]
            line = (f"batch {batch:>2} {mode:>9}: {r['cpu_s_per_step']:8.2f} CPU s/step, "
                    f"{r['cpu_s_per_step'] * 1000 / (batch * seq):6.3f} s per 1000 tokens")
            if mode != "0" and "0" in args.modes:
                rounds = [x / y for x, y in zip(r["cpu_s_per_step_each"],
                                                runs["0", batch]["cpu_s_per_step_each"])]
                line += (f", mode/0 x{harness.lower_median(rounds):.3f} "
                         f"({' '.join(f'{x:.3f}' for x in rounds)})")
            print(line)
    return result


def plot(path, args, fits):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"0": "RECOMPUTE=0", "full": '"full"', "attention": '"attention"'}
    n = MODELS[args.model]["blocks"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for mode in args.modes:
        for ax, key in ((left, "kept"), (right, "projected")):
            points = [(s, fits[s][mode][key]) for s in args.seqs if fits[s][mode][key]]
            if points:
                ax.plot(*zip(*points), marker="o", label=names[mode])
    right.axhline(args.budget_gib * 1024, color="grey", linestyle=":",
                  label=f"budget {args.budget_gib:g} GiB")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(args.seqs)
        ax.set_xticklabels([str(s) for s in args.seqs])
        ax.set_xlabel("sequence length")
        ax.legend()
    left.set_ylabel("MiB per sample")
    left.set_title("kept per decoder block (measured)")
    right.set_title(f"per sample, {n} blocks (projected)")
    fig.suptitle(f"keras-hub {args.model}-shaped decoder, LoRA, TensorFlow float32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _progress(f"plot written to {path}")


# --------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
    parser = harness.parser(
        TOOL,
        "Activation memory and time of a keras-hub causal LM at real widths with LoRA, "
        "without recomputation and with each policy of recompute.keras_hub.patch.",
    )
    parser.add_argument("--model", choices=tuple(MODELS), default="gemma-2b",
                        help="widths of gemma-2b (default), gemma-7b, llama-7b, or tiny (tests)")
    parser.add_argument("--seqs", type=harness.int_list, default=(1024, 2048),
                        help="comma-separated sequence lengths (default 1024,2048)")
    parser.add_argument("--modes", type=harness.name_list(MODES), default=MODES,
                        help="comma-separated: 0 (RECOMPUTE=0), attention, full (default all)")
    parser.add_argument("--layers", type=harness.int_list, default=(1, 2),
                        help="comma-separated decoder block counts (default 1,2): the memory kept "
                             "per block is the slope between them")
    parser.add_argument("--batch-sizes", type=harness.int_list, default=(1, 2),
                        help="comma-separated batch sizes (default 1,2): per sample is the slope")
    for flag, kind, default, text in (
            ("--steps", harness.positive_int, 1,
             "measured steps per configuration, or rounds with --paired"),
            ("--vocab", harness.positive_int, 1000, "vocabulary"),
            ("--rank", harness.positive_int, 8, "LoRA rank"),
            ("--dropout", harness.fraction, 0.0, "dropout rate (Gemma's presets: 0)"),
            ("--budget-gib", harness.positive_float, 24.0,
             "activation memory budget of the projection, GiB"),
            ("--rss-limit-gib", harness.positive_float, 20.0,
             "stop a worker past this resident memory, GiB"),
            ("--predict-seq", harness.positive_int, None,
             "also predict the real model's bfloat16 step at this seq, batch 1")):
        parser.add_argument(flag, type=kind, default=default,
                            help=text if default is None else f"{text} (default {default:g})")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow",
                        help="tensorflow (default): its CPU allocator's peak of a step, a fresh "
                             "process per configuration; jax: JAX's saved residuals (shapes only)")
    parser.add_argument("--paired", action="store_true",
                        help="time ratios: every mode in one process at the first --seqs and "
                             "--layers, --steps rounds")
    parser.add_argument("--plot", metavar="PATH", help="write the PNG to PATH")
    harness.add_output_arguments(parser, TOOL)
    args = parser.parse_args(argv)
    args.layers, args.batch_sizes = tuple(sorted(args.layers)), tuple(sorted(args.batch_sizes))
    return _checked_args(parser, args)


def _checked_args(parser, args):
    """`args`, after refusing what does not go together (`parser.error`)."""
    if args.worker and args.backend == "jax":
        return args
    if args.worker:
        if not args.out or len(args.seqs) != 1 or len(args.layers) != 1 or (
                not args.paired and (len(args.batch_sizes) != 1 or len(args.modes) != 1)):
            parser.error("--worker needs --out, one seq, one block count and one mode and batch "
                         "size (or --paired)")
        return args
    if args.paired and (len(args.seqs) != 1 or len(args.layers) != 1):
        parser.error("--paired measures one seq and one block count. Received: "
                     f"--seqs={','.join(map(str, args.seqs))} --layers={','.join(map(str, args.layers))}")
    if not args.paired and (len(args.batch_sizes) < 2 or len(args.layers) < 2):
        parser.error("the memory per sample and per block are slopes: give at least 2 --batch-sizes "
                     f"and 2 --layers. Received: --batch-sizes={','.join(map(str, args.batch_sizes))} "
                     f"--layers={','.join(map(str, args.layers))}")
    if args.paired and (args.plot or args.backend == "jax"):
        parser.error("--paired times TensorFlow steps (no --plot, no --backend jax)")
    harness.check_docs_page(parser, args.docs, TOOL, block=docs_block(args))
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        if path:
            harness.existing_folder(parser, flag, path)
    return args


def docs_block(args):
    """The docs block of this kind of run: one per model, and one per model for --paired."""
    return f"{TOOL} {args.model}{' paired' if args.paired else ''}{' jax' if args.backend == 'jax' else ''}"


def main(argv=None):
    """Entry point; a worker's failure (RuntimeError) is reported, exit code 1."""
    args = parse_args(argv)
    try:
        return _main(args, argv)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(args, argv):
    if args.worker and args.backend == "jax":
        jax_residuals(args, args.seqs[0], args.out)
        return 0
    if args.worker:
        cfg = _cfg(args, args.layers[0], args.seqs[0])
        if args.paired:
            recompute_memory.run_paired_worker(cfg, args.model, args.modes, args.batch_sizes,
                                               args.steps, args.out, build=build, progress=_progress)
        else:
            recompute_memory.run_worker(cfg, args.model, args.modes[0], args.batch_sizes[0],
                                        args.steps, args.out, build=build, progress=_progress)
        return 0
    start = time.perf_counter()
    if args.paired:
        with harness.report_to_docs(args.docs, TOOL, argv, block=docs_block(args)):
            result = paired(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(config=vars(args), **result), f, indent=2)
        return 0
    results = sweep(args)
    fits = {seq: {mode: fit(results[seq][mode], args.model) for mode in args.modes}
            for seq in args.seqs}
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    with harness.report_to_docs(args.docs, TOOL, argv, block=docs_block(args)):
        print_report(args, results, fits)
    if args.plot:
        plot(args.plot, args, fits)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), fits={str(s): v for s, v in fits.items()},
                           runs={str(s): {m: {f"{n},{b}": r for (n, b), r in runs.items()}
                                          for m, runs in by_mode.items()}
                                 for s, by_mode in results.items()}), f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
