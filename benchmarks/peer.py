"""Peer benchmark: our recomputation against PyTorch's on the same BERT-base classifier.

    python -m benchmarks.peer                                   # BERT-base, seq 512, batches 8,32
    KERAS_BACKEND=jax python -m benchmarks.peer --precision bf16
    python -m benchmarks.peer --model standard --policies 0,full --no-peer
    python -m benchmarks.peer --layers 2 --hidden 64 --heads 2 --ffn 128 --seq 32 \\
        --batches 2,4 --steps 2                                 # a tiny smoke run

What is trained, on both sides: a BERT classifier (default BERT-base: 12
layers, hidden 768, 12 heads, FFN 3072, vocabulary 30522, seq 512, dropout
0.1 on hidden states and attention probabilities), random initialisation,
the pooled [CLS] (first) token through dropout into a 2-way `Dense` head,
sparse cross-entropy, AdamW (learning rate 1e-4, weight decay 0.01), one
training step per batch. The data are random token ids whose last quarter of
every sequence is padding (id 0, padding/attention mask 0 there), random
labels; the same NumPy arrays on both sides.

- The project (`--model`), on the Keras 3 backend at hand (KERAS_BACKEND,
  TensorFlow by default, or JAX), trained with `model.train_on_batch` (on
  TensorFlow compiled with `jit_compile=False`: its CPU allocator does not
  count XLA's buffers):
  `hub` (default) is keras-hub's `BertBackbone`; `standard` is the standard
  Keras 3 block of `benchmarks.encoder` (`MultiHeadAttention`, `Dense`,
  `Dropout`, `LayerNormalization`) stacked to the same depth, which takes no
  padding mask (the padded quarter is attended to). Rows (`--policies`):
  `0` (RECOMPUTE=0; keras-hub unpatched), `attention`
  (`recompute.keras_hub.patch(policy="attention")`, RECOMPUTE=1) and `full`
  (`patch()`, RECOMPUTE=1); for `standard`, its blocks decorated with
  `recompute_grad(policy=...)`.
- The peer, only where `torch` and `transformers` are importable already
  (torch is no dependency of this project, and `--no-peer` skips it):
  Hugging Face's `BertForSequenceClassification` of the same configuration,
  attention `sdpa` and `eager`, each without and with
  `model.gradient_checkpointing_enable()`, `torch.optim.AdamW`. Without
  them one line says the peer rows were skipped and why.

Every configuration (row, batch) runs in a fresh worker process
(`python -m benchmarks.peer --worker ...`), the project's first, then the
peer's (one framework at a time), the rows in turn at each batch. A worker
runs a first step (its loss is the row's "first loss" at the smallest
batch), a warm-up step and then `--steps` measured steps at the largest
batch (2 at the others). It measures:

- memory per step: with a GPU visible, the framework's allocator --
  TensorFlow's `get_memory_info("GPU:0")["peak"]` minus `current` before the
  step (statistics reset before each step; the median step), JAX's
  `memory_stats()["peak_bytes_in_use"]` of the process, torch's
  `max_memory_allocated()` minus `memory_allocated()` before the step (peak
  reset before each step; the median step); on a CPU, TensorFlow's CPU
  allocator the same way (the workers get `TF_ENABLE_ONEDNN_OPTS=1` unless
  set), on JAX the saved residuals of the loss (what `jax.vjp` keeps, as in
  `benchmarks.recompute_memory --backend jax`), on torch the bytes of the
  distinct storages saved for backward (`saved_tensors_hooks`, parameters
  left out). The MiB/sample is the slope of these between the batches
  (weights, gradients and optimizer state cancel);
- step time: the median wall time of the measured steps at the largest batch.

The table, one row per configuration: MiB/sample, "saved" (the ratio of the
baseline's MiB/sample to the row's: the baseline is RECOMPUTE=0 for the
project, and for the peer the same attention without checkpointing), the
step time and its ratio to the baseline's, the estimated batch in a budget
(`--budget-gib`, default 16: floor(budget / MiB per sample), which ignores
the weights, gradients and optimizer state) and the first loss. Our rows'
first losses are equal (recomputation is exact, dropout replayed; the same
seed); across frameworks they are not expected to be (other initial
weights and dropout masks). A configuration that runs out of memory shows
"OOM @ B" in its row (B: the batch), not a crash; a worker that failed
otherwise shows "failed @ B" (its stderr tail goes above the table, and the
exit code is 1).

Precision (`--precision`, both sides): `fp32` (default) turns TF32 off --
JAX `jax_default_matmul_precision="highest"`, TensorFlow
`enable_tensor_float_32_execution(False)`, torch
`backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = False`;
`tf32` turns it on (JAX "tensorfloat32"); `bf16` is Keras's
`mixed_bfloat16` policy (the head's logits in float32) and torch's
`autocast(dtype=torch.bfloat16)`.

Limits: TensorFlow's CPU allocator does not count tensors of a few KiB, so
a very small shape reads about 0 MiB/sample (hidden 128, seq 64 is about
the smallest it sees). JAX on a GPU has no peak reset, so its figure is the process's
peak (fixed parts cancel in the slope); on a CPU the three sides measure
different things (an allocator, residuals, saved storages): compare the
ratios within a framework, not MiB across. Time ratios compare only rows
of one framework; on shared CPU cores they are noisy. `recompute` imports
TensorFlow on every backend, so the project side needs the project's
install (a machine with torch alone runs only the peer rows, the project's
rows then read "failed"). Progress lines go to stderr, the table to stdout;
`--json PATH` saves every result; `--docs PAGE` writes the report into a
docs/ page.
"""

import argparse
import importlib.util
import json
import math
import os
import sys
import time

from . import harness
from .harness import GiB, MiB

TOOL = "benchmarks.peer"
_progress = harness.Progress(TOOL)

DEFAULTS = dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522, dropout=0.1,
                batches=(8, 32), steps=10, budget_gib=16.0, precision="fp32", model="hub",
                policies=("0", "attention", "full"))
PRECISIONS = ("fp32", "tf32", "bf16")
MODELS = ("hub", "standard")
POLICIES = ("0", "attention", "full")
PEER_ROWS = (("sdpa", False), ("sdpa", True), ("eager", False), ("eager", True))
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.01
SMALL_BATCH_STEPS = 2  # measured steps at the batches below the largest


# --------------------------------------------------------------------------
# Data (both sides): NumPy arrays.


def make_batch(batch, seq, vocab, seed):
    """(token ids, padding mask, labels) of `batch` random sequences whose last quarter
    (seq // 4 positions) is padding: id 0, mask 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(batch, seq)).astype("int32")
    mask = np.broadcast_to(np.arange(seq)[None, :] < seq - seq // 4, (batch, seq))
    ids = np.where(mask, ids, 0).astype("int32")
    labels = rng.integers(0, 2, size=(batch,)).astype("int32")
    return ids, mask.astype("int32"), labels


def _batches(cfg, batch, n):
    """The n batches a worker trains on at `batch`: the same on every row and side."""
    return [make_batch(batch, cfg["seq"], cfg["vocab"], seed=1000 * batch + i) for i in range(n)]


# --------------------------------------------------------------------------
# Worker: the project's side (Keras 3, the backend at hand).


def _keras_precision(precision, backend):
    import keras

    if backend == "jax":
        import jax

        if precision != "bf16":
            jax.config.update("jax_default_matmul_precision",
                              "highest" if precision == "fp32" else "tensorfloat32")
    elif backend == "tensorflow":
        import tensorflow as tf

        if precision != "bf16":
            tf.config.experimental.enable_tensor_float_32_execution(precision == "tf32")
    if precision == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")


def keras_model(cfg, model_name, row, offload=False):
    """The classifier of `model_name` for the project row `row` (RECOMPUTE is set by the
    parent): keras-hub's BertBackbone, patched unless row 0 (a fresh process: row 0 does not
    unpatch), or the standard blocks; `offload`: `recompute_grad`'s, for row "full".
    `benchmarks.gpu_plan` builds its rows with it too."""
    import keras

    from . import encoder

    if model_name == "standard":
        model, _ = encoder.build_jax_model(cfg, policy="full" if row == "0" else row,
                                           offload=offload)
        return model
    import keras_hub

    if row != "0":
        import recompute.keras_hub

        recompute.keras_hub.patch(policy=row, offload=offload)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=cfg["vocab"], num_layers=cfg["layers"], num_heads=cfg["heads"],
        hidden_dim=cfg["hidden"], intermediate_dim=cfg["ffn"],
        max_sequence_length=cfg["seq"], dropout=cfg["dropout"])
    inputs = {name: keras.Input((cfg["seq"],), dtype="int32", name=name)
              for name in ("token_ids", "segment_ids", "padding_mask")}
    pooled = backbone(inputs)["pooled_output"]  # the [CLS] token through the pooler
    logits = keras.layers.Dense(2, dtype="float32", name="classifier")(
        keras.layers.Dropout(cfg["dropout"])(pooled))
    return keras.Model(inputs, logits)


def keras_inputs(model_name, ids, mask):
    """The inputs of `keras_model(cfg, model_name, ...)` for `make_batch`'s ids and mask."""
    import numpy as np

    if model_name == "standard":
        return ids
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}


def run_keras_worker(cfg, model_name, row, batch, steps, precision, out_path):
    import keras

    import recompute

    backend = keras.backend.backend()
    _keras_precision(precision, backend)
    tag = f"{backend} {model_name} row={row} batch={batch}"
    _progress(f"{tag}: building the model")
    model = keras_model(cfg, model_name, row)
    # TensorFlow: a `tf.function` without XLA, whose tensors its allocator counts (on a CPU
    # it does not see XLA's buffers); JAX: jitted as always.
    model.compile(optimizer=keras.optimizers.AdamW(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False if backend == "tensorflow" else "auto")
    data = [(keras_inputs(model_name, ids, mask), labels)
            for ids, mask, labels in _batches(cfg, batch, steps + 2)]

    def step(i):
        return float(keras.ops.convert_to_numpy(model.train_on_batch(*data[i])))

    gpu = _keras_gpu(backend)
    residuals = None
    if backend == "jax" and not gpu:
        residuals = _jax_residuals(model, *data[0])
    t0 = time.perf_counter()
    first_loss = step(0)
    _progress(f"{tag}: compiled and ran the first step in {time.perf_counter() - t0:.1f} s")
    step(1)
    measured = []  # (loss, bytes or None, wall s)
    for i in range(2, steps + 2):
        if backend == "tensorflow":
            loss, peak, _, wall = harness.allocator_step(lambda: step(i))
        else:
            w0 = time.perf_counter()
            loss, peak = step(i), None
            wall = time.perf_counter() - w0
        measured.append((loss, peak, wall))
    if backend == "tensorflow":
        memory = harness.lower_median([m[1] for m in measured])
        measure = f"TensorFlow's allocator of {harness.measured_device()} (peak of a step)"
    elif gpu:
        import jax

        memory = int(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
        measure = "JAX's GPU allocator (peak of the process)"
    else:
        memory = residuals
        measure = "JAX's saved residuals (CPU)"
    result = dict(side="project", backend=backend, model=model_name, row=row, batch=batch,
                  memory_bytes=int(memory), measure=measure, first_loss=first_loss,
                  step_s=harness.lower_median([m[2] for m in measured]),
                  step_s_each=[m[2] for m in measured], precision=precision,
                  recompute=os.environ.get(recompute.ENV_VAR, ""),
                  recompute_enabled=recompute.is_enabled(),
                  params=int(model.count_params()))
    _progress(f"{tag}: {memory / MiB:.1f} MiB, {result['step_s']:.3f} s/step, "
              f"first loss {first_loss:.6f}")
    harness.write_result(out_path, result)


def _keras_gpu(backend):
    if backend == "tensorflow":
        return harness.measured_device().startswith("GPU")
    if backend == "jax":
        import jax

        return jax.default_backend() == "gpu"
    return False


def _jax_residuals(model, x, y):
    """What JAX keeps for the backward pass of the training loss (shapes only)."""
    import keras

    from .recompute_memory import saved_residual_bytes

    non_trainable = [v.value for v in model.non_trainable_variables]
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(trainable):
        logits, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return cross_entropy(y, logits)

    return saved_residual_bytes(loss, [v.value for v in model.trainable_variables])


# --------------------------------------------------------------------------
# Worker: the peer (PyTorch + transformers), imported only here.


def peer_available():
    """(True, None) if torch and transformers are importable, else (False, why)."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not importable"
    return True, None


def peer_row_name(attention, checkpointing):
    return f"{attention}{' + checkpointing' if checkpointing else ''}"


def run_torch_worker(cfg, row, batch, steps, precision, out_path):
    import contextlib

    import torch
    import transformers

    attention, checkpointing = next(r for r in PEER_ROWS if peer_row_name(*r) == row)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if precision != "bf16":
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    tag = f"torch {row} batch={batch}"
    _progress(f"{tag}: building the model (transformers {transformers.__version__})")
    model = _torch_model(cfg, attention, checkpointing, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    data = [tuple(torch.from_numpy(a).long().to(device) for a in b)
            for b in _batches(cfg, batch, steps + 2)]
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if precision == "bf16" \
        else contextlib.nullcontext
    step = _torch_step(model, optimizer, data, autocast)

    t0 = time.perf_counter()
    first_loss = step(0)
    _progress(f"{tag}: ran the first step in {time.perf_counter() - t0:.1f} s")
    step(1)
    measured = _torch_measured(step, steps, gpu)
    memory = harness.lower_median([m[1] for m in measured])
    result = dict(side="peer", backend="torch", model="transformers BertForSequenceClassification",
                  row=row, batch=batch, memory_bytes=int(memory),
                  measure=("torch's CUDA allocator (peak of a step)" if gpu else
                           "torch's tensors saved for backward (CPU)"),
                  first_loss=first_loss, step_s=harness.lower_median([m[2] for m in measured]),
                  step_s_each=[m[2] for m in measured], precision=precision,
                  attn_implementation=getattr(model.config, "_attn_implementation", None),
                  torch=torch.__version__, transformers=transformers.__version__,
                  params=int(sum(p.numel() for p in model.parameters())))
    _progress(f"{tag}: {memory / MiB:.1f} MiB, {result['step_s']:.3f} s/step, "
              f"first loss {first_loss:.6f}")
    harness.write_result(out_path, result)


def _torch_model(cfg, attention, checkpointing, device):
    """transformers' `BertForSequenceClassification` of the shape `cfg`, in training mode."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], intermediate_size=cfg["ffn"],
        max_position_embeddings=cfg["seq"], hidden_dropout_prob=cfg["dropout"],
        attention_probs_dropout_prob=cfg["dropout"], num_labels=2)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).to(device)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _torch_step(model, optimizer, data, autocast):
    """`step(i, saved=None)`: one train step on `data[i]`, its loss; with a dict `saved`, the
    bytes of each tensor storage saved for backward (not a parameter's) noted in it."""
    import contextlib

    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(i, saved=None):
        ids, mask, labels = data[i]
        optimizer.zero_grad(set_to_none=True)
        hooks = contextlib.nullcontext()
        if saved is not None:
            def pack(t):
                storage = t.untyped_storage()
                if storage.data_ptr() not in parameters:
                    saved[storage.data_ptr()] = storage.nbytes()
                return t
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, autocast():
            loss = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                         labels=labels).loss
        loss.backward()
        optimizer.step()
        return float(loss.item())  # waits for the step

    return step


def _torch_measured(step, steps, gpu):
    """`(loss, peak bytes, wall s)` of the steps 2 to `steps + 1` (the CUDA allocator's peak,
    or on the CPU the tensors saved for backward)."""
    import torch

    measured = []
    for i in range(2, steps + 2):
        saved = None if gpu else {}
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        w0 = time.perf_counter()
        loss = step(i, saved)
        wall = time.perf_counter() - w0
        peak = torch.cuda.max_memory_allocated() - before if gpu else sum(saved.values())
        measured.append((loss, peak, wall))
    return measured


def run_worker(args):
    cfg = shape_config(args)
    steps = args.steps if args.batch == max(args.batches) else min(args.steps, SMALL_BATCH_STEPS)
    try:
        if args.side == "peer":
            run_torch_worker(cfg, args.row, args.batch, steps, args.precision, args.out)
        else:
            run_keras_worker(cfg, args.model, args.row, args.batch, steps, args.precision, args.out)
    except Exception as e:  # noqa: BLE001 -- an OOM is a result; anything else a failure
        if not harness.is_oom(e):
            raise
        _progress(f"{args.side} row={args.row} batch={args.batch}: out of memory")
        harness.write_result(args.out, dict(side=args.side, row=args.row, batch=args.batch,
                                            oom=True, error=str(e)[:2000]))


# --------------------------------------------------------------------------
# Parent: the table (pure functions of the workers' results).


def summarize(results, rows, batches, budget_bytes):
    """One entry per row (`rows`: [(side, row name, baseline row name)]) from the workers'
    results ({(side, row, batch): result or None}): per-sample memory (the slope between
    `batches`), the ratios to the baseline row, the step time at the largest batch, the
    estimated batch in `budget_bytes`, the first loss at the smallest batch. A row with
    an OOM or a failed worker has `status` "OOM at batch N" / "failed at batch N"."""
    largest, smallest = max(batches), min(batches)
    out = {}
    for side, row, _ in rows:
        mine = {b: results.get((side, row, b)) for b in batches}
        status = None
        for b in sorted(batches):
            r = mine[b]
            if r is None:
                status = status or f"failed at batch {b}"
            elif r.get("oom"):
                status = status or f"OOM at batch {b}"
        entry = dict(side=side, row=row, status=status, per_sample_bytes=None, step_s=None,
                     first_loss=None, budget_batch=None, saved=None, time_ratio=None)
        if mine[smallest] is not None and not mine[smallest].get("oom"):
            entry["first_loss"] = mine[smallest]["first_loss"]
        if mine[largest] is not None and not mine[largest].get("oom"):
            entry["step_s"] = mine[largest]["step_s"]
        if status is None:
            per_sample, fixed = harness.slope([(b, mine[b]["memory_bytes"]) for b in batches])
            entry.update(per_sample_bytes=per_sample, fixed_bytes=fixed,
                         measure=mine[largest]["measure"])
            if per_sample > 0:
                entry["budget_batch"] = int(math.floor(budget_bytes / per_sample))
        out[side, row] = entry
    for side, row, base in rows:
        entry, baseline = out[side, row], out.get((side, base))
        if baseline is None:
            continue
        if entry["per_sample_bytes"] and baseline["per_sample_bytes"]:
            entry["saved"] = baseline["per_sample_bytes"] / entry["per_sample_bytes"]
        if entry["step_s"] and baseline["step_s"]:
            entry["time_ratio"] = entry["step_s"] / baseline["step_s"]
    return [out[side, row] for side, row, _ in rows]


def row_label(side, row, model_name="hub"):
    if side == "peer":
        return f"torch {row}"
    target = "keras-hub" if model_name == "hub" else "standard"
    return {"0": f"{target} RECOMPUTE=0",
            "attention": f"{target} attention" if model_name == "standard"
            else 'patch(policy="attention")',
            "full": f"{target} full" if model_name == "standard" else "patch() (full)"}[row]


def format_table(entries, budget_gib, model_name="hub"):
    """The table's lines."""
    budget = f"batch in {budget_gib:g} GiB"
    lines = [f"{'row':<42} {'MiB/sample':>11} {'saved':>7} {'s/step':>8} {'time':>7} "
             f"{budget:>14} {'first loss':>11}"]
    for e in entries:
        label = row_label(e["side"], e["row"], model_name)
        if e["status"]:
            # "OOM @ 32": out of memory at batch 32 ("failed @ 32": the worker failed).
            memory, saved, budget_batch = e["status"].replace(" at batch ", " @ "), "-", "-"
        else:
            mib = e["per_sample_bytes"] / MiB
            memory = f"{mib:.1f}" if abs(mib) >= 10 else f"{mib:.2f}"
            saved = f"x{e['saved']:.2f}" if e["saved"] else "-"
            budget_batch = str(e["budget_batch"]) if e["budget_batch"] is not None else "-"
        step = f"{e['step_s']:.3f}" if e["step_s"] is not None else "-"
        ratio = f"x{e['time_ratio']:.2f}" if e["time_ratio"] else "-"
        loss = f"{e['first_loss']:.6f}" if e["first_loss"] is not None else "-"
        lines.append(f"{label:<42} {memory:>11} {saved:>7} {step:>8} {ratio:>7} "
                     f"{budget_batch:>14} {loss:>11}")
    return lines


def print_report(cfg, args, backend, entries, skipped, out=None):
    out = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=out)  # noqa: E731
    batches = sorted(args.batches)
    model = ("keras-hub BertBackbone" if args.model == "hub" else
             "the standard Keras 3 block (no padding mask)")
    p(f"peer benchmark: BERT classifier, {cfg['layers']} layers, hidden {cfg['hidden']}, "
      f"{cfg['heads']} heads, FFN {cfg['ffn']}, vocab {cfg['vocab']}, seq {cfg['seq']} "
      f"(last {cfg['seq'] // 4} positions padding), dropout {cfg['dropout']}, AdamW, precision "
      f"{args.precision}; project: {model} on Keras 3 {backend}")
    measures = []
    for e in entries:
        m = e.get("measure")
        if m and (e["side"], m) not in measures:
            measures.append((e["side"], m))
    p("memory: slope of " + "; ".join(f"{'ours' if s == 'project' else 'peer'}: {m}"
                                      for s, m in measures)
      + f" between batches {','.join(map(str, batches))}")
    p(f"saved, time: ratios to the row's baseline (ours: RECOMPUTE=0; peer: the same attention "
      f"without checkpointing); s/step: median of {args.steps} steps at batch {batches[-1]}; "
      f"batch in {args.budget_gib:g} GiB = floor(budget / MiB per sample), ignoring weights, "
      f"gradients and optimizer state; first loss at batch {batches[0]}")
    p("")
    for line in format_table(entries, args.budget_gib, args.model):
        p(line)
    if skipped:
        p("")
        p(f"peer rows skipped: {skipped}")


# --------------------------------------------------------------------------
# Command line.


def _int_at_least_1(flag, text):
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise ValueError(f"`{flag}` must be an integer >= 1. Received: {flag}={text}")
    return value


def _check(parser, args):
    """Converts and checks the options given as text; `parser.error` names what was
    expected and what was received."""
    try:
        for key in ("layers", "hidden", "heads", "ffn", "seq", "vocab", "steps"):
            value = getattr(args, key)
            setattr(args, key, DEFAULTS[key] if value is None
                    else _int_at_least_1(f"--{key}", value))
        if args.batches is None:
            args.batches = DEFAULTS["batches"]
        else:
            try:
                batches = tuple(int(t) for t in args.batches.split(",") if t.strip())
            except ValueError:
                batches = ()
            need = 1 if args.worker else 2
            if len(batches) < need or len(set(batches)) != len(batches) or min(batches) < 1:
                raise ValueError(f"`--batches` must be at least {need} distinct integers >= 1, "
                                 f"comma-separated (e.g. 8,32). Received: --batches={args.batches}")
            args.batches = batches
        for key, flag, ok, expected in (
                ("dropout", "--dropout", lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
                ("budget_gib", "--budget-gib", lambda v: 0.0 < v < float("inf"), "a number > 0")):
            value = getattr(args, key)
            if value is None:
                setattr(args, key, DEFAULTS[key])
                continue
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not ok(number):
                raise ValueError(f"`{flag}` must be {expected}. Received: {flag}={value}")
            setattr(args, key, number)
        for key, choices in (("precision", PRECISIONS), ("model", MODELS)):
            value = getattr(args, key)
            if value is None:
                setattr(args, key, DEFAULTS[key])
            elif value not in choices:
                raise ValueError(f"`--{key}` must be one of {', '.join(choices)}. "
                                 f"Received: --{key}={value}")
        if args.policies is None:
            args.policies = DEFAULTS["policies"]
        else:
            policies = tuple(t.strip() for t in args.policies.split(",") if t.strip())
            if not policies or any(p not in POLICIES for p in policies) \
                    or len(set(policies)) != len(policies):
                raise ValueError(f"`--policies` must be distinct items of {', '.join(POLICIES)}, "
                                 f"comma-separated. Received: --policies={args.policies}")
            args.policies = tuple(p for p in POLICIES if p in policies)
        if args.hidden % args.heads:
            raise ValueError(f"`--hidden` must be divisible by `--heads`. Received: "
                             f"--hidden={args.hidden}, --heads={args.heads}")
    except ValueError as e:
        parser.error(str(e))


def parse_args(argv=None):
    parser = harness.parser(
        "benchmarks.peer",
        "Activation memory per sample, step time, the batch in a budget and the first "
        "loss of a BERT classifier trained through the project (every recomputation "
        "policy) and, where torch and transformers are importable, through Hugging Face "
        "transformers (sdpa and eager attention, with and without gradient "
        "checkpointing); each configuration in a fresh process.",
    )
    d = DEFAULTS
    for key, what in (("layers", "encoder layers"), ("hidden", "hidden size"),
                      ("heads", "attention heads"), ("ffn", "FFN inner size"),
                      ("seq", "sequence length (its last quarter is padding)"),
                      ("vocab", "vocabulary size")):
        parser.add_argument(f"--{key}", metavar="N", help=f"{what} (default {d[key]})")
    for flag, metavar, text in (
        ("--dropout", "RATE", f"dropout rate (default {d['dropout']})"),
        ("--batches", "B1,B2", "comma-separated batch sizes; MiB/sample is the slope between "
                               "them (default 8,32)"),
        ("--steps", "N", f"measured steps at the largest batch (default {d['steps']})"),
        ("--precision", "fp32|tf32|bf16", "fp32 (default: TF32 off), tf32, or bf16 (Keras "
                                          "mixed_bfloat16, torch autocast): applied to both sides"),
        ("--model", "hub|standard", "our side: keras-hub's BertBackbone (hub, default) or the "
                                    "standard Keras 3 block of benchmarks.encoder (standard)"),
        ("--policies", "LIST", "our rows: comma-separated items of 0 (RECOMPUTE=0), attention, "
                               "full (default all)"),
        ("--budget-gib", "GIB", "memory budget of the estimated batch (default 16)"),
    ):
        parser.add_argument(flag, metavar=metavar, help=text)
    parser.add_argument("--no-peer", action="store_true",
                        help="skip the PyTorch rows even where torch is importable")
    parser.add_argument("--timeout", type=harness.positive_float, default=None,
                        help=argparse.SUPPRESS)
    harness.add_output_arguments(parser, TOOL)
    parser.add_argument("--side", choices=("project", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _check(parser, args)
    harness.check_docs_page(parser, args.docs, TOOL)
    harness.check_json_folder(parser, args)
    if args.worker and not (args.out and args.side and args.row and args.batch):
        parser.error("--worker needs --out, --side, --row and --batch")
    return args


def shape_config(args):
    return {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq", "vocab",
                                          "dropout")}


def _worker_argv(args, side, row, batch):
    argv = ["--side", side, "--row", row, "--batch", str(batch),
            "--batches", ",".join(map(str, args.batches)), "--steps", str(args.steps),
            "--precision", args.precision, "--model", args.model]
    for key, value in shape_config(args).items():
        argv += [f"--{key}", str(value)]
    return argv


def _spawn(args, side, row, batch):
    _progress(f"{side} row={row} batch={batch}: starting a fresh worker process")
    env = dict(harness.allocator_env())
    if side == "project":
        env["RECOMPUTE"] = "0" if row == "0" else "1"
    runs = harness.run_workers(_progress, _worker_argv(args, side, row, batch), [env],
                               timeout=args.timeout)
    run = runs[0]
    if run.result is None:
        sys.stderr.write(run.tail)
        _progress(f"{side} row={row} batch={batch}: the worker {run.failure(args.timeout)} "
                  f"(its last stderr lines are above)")
    return run.result


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    start = time.perf_counter()
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    batches = sorted(args.batches)
    rows = [("project", p, "0") for p in args.policies]
    available, why = peer_available()
    skipped = "--no-peer" if args.no_peer else (None if available else why)
    if not skipped:
        rows += [("peer", peer_row_name(*r), peer_row_name(r[0], False)) for r in PEER_ROWS]
    results = {}
    for side in ("project", "peer"):  # one framework at a time
        for batch in batches:
            for s, row, _ in rows:
                if s == side:
                    results[side, row, batch] = _spawn(args, side, row, batch)
    entries = summarize(results, rows, batches, args.budget_gib * GiB)
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    with harness.report_to_docs(args.docs, TOOL, argv):
        print_report(shape_config(args), args, backend, entries, skipped)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=dict(shape_config(args), batches=batches, steps=args.steps,
                                       precision=args.precision, model=args.model,
                                       backend=backend, budget_gib=args.budget_gib),
                           results=[r for r in results.values() if r is not None],
                           rows=entries, peer_skipped=skipped), f, indent=2)
        _progress(f"results saved to {args.json}")
    failed = [e for e in entries if e["status"] and e["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
