"""Peak memory of one whole LoRA training step of a keras-hub causal LM on JAX, per policy.

    KERAS_BACKEND=jax python -m benchmarks.lm_step        # Gemma-7B, bf16, seq 8192: 0,full,chunked
    KERAS_BACKEND=jax python -m benchmarks.lm_step --model gemma-2b --seq 4096 --modes full
    python -m benchmarks.lm_step --target h100 --modes full,chunked    # XLA:GPU's plan, no GPU
    KERAS_BACKEND=jax python -m benchmarks.lm_step --model tiny --seq 64 --vocab 1000  # seconds

`benchmarks.lm_memory` measures a few blocks and projects; this tool runs the
real model: every decoder block (`--layers`, default the model's), its real
vocabulary (`--vocab`, default the model's), weights in `--dtype` (default
bfloat16, Keras's dtype policy: weights and compute), random initialization,
`backbone.enable_lora(--rank)`, keras-hub's `compile` (its loss, sparse
cross-entropy from the logits, and its weighted accuracy) with Adam over the
LoRA factors, batch 1 of `--seq` tokens (random ids, each the next one's
target), learning rate `--learning-rate` (default 0: the step computes and
applies everything -- gradients, Adam's slots, the update -- but the weights
stay, so every mode and step sees the same model and their losses must be
equal: recomputation and the chunked loss are exact; a check the table shows,
not only a measurement). The step is Keras's own JAX `train_step` (what `fit`
runs), `jax.jit` with the whole state donated (as Keras's JAX trainer does).

Modes (`--modes`): `0` (RECOMPUTE off), `full`/`attention`
(`recompute.keras_hub.patch(policy=...)`, recomputation on while the step is
traced: `recompute.recompute_scope`) and `chunked` (`"full"` with
`recompute.keras_hub.chunked_loss(lm, --chunk-tokens)`: the head and loss in
chunks of tokens, never the [tokens, vocabulary] logits). The model is built
once; each mode's step is compiled ahead of time (`jax.jit(...).lower(...)
.compile()`), which gives XLA's plan of its memory (`memory_analysis()`:
arguments, outputs not aliased to them, temporaries). Then the modes run in the
order of their plans, smallest first (the allocator's peak only grows),
`--steps` steps each, and the peak of the accelerator's allocator
(`memory_stats()["peak_bytes_in_use"]`) is read before and after each mode's
steps (JAX cannot reset it: where the steps did not raise it, the table says the
step's peak is at most that -- compiling, whose autotuning allocates on the
device, can reach it first). A mode that runs out of memory is reported as such,
with its plan; the modes after it are not run (the donated state is gone). On a
CPU (no allocator statistics) only the plans are reported.

`--target h100|a100-40|l4|rtx4090`: XLA:GPU's plan of the same steps for that
GPU, compiled on this machine (`benchmarks.gpu_plan`'s target: no GPU needed,
nothing runs; the backbone's weights are made without values, so a Gemma-7B plan
needs no 17 GiB of memory). One difference from a real GPU remains: keras-hub's
decoders take the fused attention op (`ops.dot_product_attention`, cuDNN's
flash attention) only when they run on a GPU and have no dropout or soft cap,
and cuDNN is needed to compile it; on this machine they take their einsum path,
which holds a block's [heads, seq, seq] scores (4 GiB in float32 for Gemma-7B
at seq 8192). The target's plan is then an upper bound of a real GPU's.

Limits: batch 1; the peak includes the weights, the LoRA optimizer state and
everything XLA holds (its plan is the reference where the step does not run);
one process, so a mode's peak is measured after the smaller modes ran (their
peaks are lower, so they do not mask it).
"""

import json
import os
import sys
import time

from . import gpu_plan, harness, lm_memory
from .harness import GiB

TOOL = "benchmarks.lm_step"
MODES = ("0", "attention", "full", "chunked")
DTYPES = ("bfloat16", "float16", "float32")
_progress = harness.Progress(TOOL)


def _stats(device):
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


def build(args):
    """(the compiled LoRA causal LM, its parameter count before LoRA). Where `args.target`
    is set, the backbone's weights have shapes and no values (a Gemma-7B plan needs no
    17 GiB of them): trace it only inside a `keras.StatelessScope(initialize_variables=
    False)`, which does not initialize them at its exit."""
    import keras

    shape = lm_memory.MODELS[args.model]
    cfg = dict(layers=args.layers or shape["blocks"], seq=args.seq,
               vocab=args.vocab or shape["vocab"], rank=args.rank, dropout=args.dropout)
    keras.config.set_dtype_policy(args.dtype)
    lm, n_params = lm_memory.causal_lm(cfg, args.model, "full", abstract=bool(args.target))
    # keras-hub's loss and weighted accuracy ("auto"), Adam over the LoRA factors
    lm.compile(optimizer=keras.optimizers.Adam(args.learning_rate))
    lm.optimizer.build(lm.trainable_variables)
    return lm, n_params


def train_state(lm, data, abstract):
    """The state of Keras's JAX `train_step` (trainable, non-trainable, optimizer and metric
    values) after one trace of it that builds what `fit` builds first (the compiled loss
    and metrics); as `jax.ShapeDtypeStruct`s where `abstract`."""
    import jax

    def shapes_or_values(groups):
        if abstract:
            return tuple([jax.ShapeDtypeStruct(tuple(v.shape), jax.numpy.dtype(v.dtype))
                          for v in group] for group in groups)
        return tuple([v.value for v in group] for group in groups)

    def groups():
        return (lm.trainable_variables, lm.non_trainable_variables, lm.optimizer.variables,
                lm.metrics_variables)

    jax.eval_shape(lambda state, data: lm.train_step(state, data)[0],
                   shapes_or_values(groups()), data)
    return shapes_or_values(groups())


def compile_step(lm, state, data, sharding):
    """(executable, XLA's plan: `recompute._xla_plan.compile_step`'s dict) of Keras's own JAX
    `train_step` of `lm` (what `fit` runs), jitted with the state donated, for the local
    device, or for `sharding`'s GPU (a `benchmarks.gpu_plan` target: nothing run)."""
    from recompute import _xla_plan

    def step(state, data):
        logs, state = lm.train_step(state, data)
        return logs["loss"], state

    return _xla_plan.compile_step(step, (state, data), sharding, donate_argnums=0)


def measure(args):
    """{config, weights, modes: {mode: {plan_bytes, temp_bytes, compile_s, peak_bytes,
    step_s, losses | oom}}} of `args`' model, every mode in this process; with
    `args.target`, XLA:GPU's plans for that GPU only (nothing runs)."""
    import jax
    import keras
    import numpy as np

    import recompute
    import recompute.keras_hub

    sharding = None
    if args.target:
        from . import gpu_plan

        sharding = gpu_plan.target_sharding(args.target)
    device = jax.devices()[0]
    where = f"a {args.target} target (XLA:GPU's plan, nothing run)" if args.target else str(device)
    t0 = time.perf_counter()
    _progress(f"building {args.model}: {args.layers or 'all'} blocks, {args.dtype}, LoRA rank "
              f"{args.rank}, for {where}")
    lm, n_params = build(args)
    if args.target:  # the backbone's weights never initialized: every trace inside this scope
        keras.StatelessScope(initialize_variables=False).__enter__()
    data = lm_memory.jax_batch(1, args.seq, lm.backbone.token_embedding.input_dim, 0)
    state = train_state(lm, data, abstract=bool(args.target))
    vocab = lm.backbone.token_embedding.input_dim
    layers = len(recompute.keras_hub.covered(lm))
    weights = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                  for v in jax.tree.leaves(state))
    lora = sum(int(np.prod(v.shape)) for v in lm.trainable_variables)
    _progress(f"built in {time.perf_counter() - t0:.0f} s: {n_params / 1e9:.2f}B parameters, "
              f"{lora} LoRA; state {weights / GiB:.2f} GiB")
    if not args.target:
        data = jax.tree.map(jax.numpy.asarray, data)

    modes, compiled = _compile_modes(args, lm, state, data, sharding)
    measurable = not args.target and _stats(device)[0] is not None
    if not args.target:
        _run_modes(args, modes, compiled, state, data, device)
    return dict(config=dict(model=args.model, layers=layers, vocab=vocab, seq=args.seq, batch=1,
                            dtype=args.dtype, rank=args.rank, dropout=args.dropout,
                            learning_rate=args.learning_rate, target=args.target,
                            chunk_tokens=recompute.keras_hub.is_chunked(lm),
                            device=where, params=n_params, lora_params=lora,
                            jax=jax.__version__, keras=keras.__version__),
                weights_bytes=weights, measurable=measurable, modes=modes)


def _compile_modes(args, lm, state, data, sharding):
    """({mode: {compile_s, plan_bytes, temp_bytes}}, {mode: executable}) of every mode of
    `args`, in `args.modes`' order."""
    import recompute
    import recompute.keras_hub

    modes, compiled = {}, {}
    # The chunked loss is set on the model itself: traced after every other mode.
    for mode in sorted(args.modes, key=lambda m: m == "chunked"):
        if mode == "chunked":
            recompute.keras_hub.chunked_loss(lm, chunk_tokens=args.chunk_tokens)
        t1 = time.perf_counter()
        with recompute.recompute_scope(mode != "0"):
            compiled[mode], plan = compile_step(lm, state, data, sharding)
        modes[mode] = dict(compile_s=round(time.perf_counter() - t1, 1),
                           plan_bytes=plan["peak"], temp_bytes=plan["temp"])
        _progress(f"mode {mode}: compiled in {modes[mode]['compile_s']:.0f} s; XLA's plan "
                  f"{plan['peak'] / GiB:.2f} GiB")
    return {mode: modes[mode] for mode in args.modes}, compiled


def _run_modes(args, modes, compiled, state, data, device):
    """Runs `args.steps` steps of each mode, the smallest plan first, each from the state the
    one before left, into `modes`; after a mode runs out of memory, the later ones are
    skipped."""
    order = sorted(args.modes, key=lambda m: modes[m]["plan_bytes"])
    for mode in order:
        losses, times = [], []
        modes[mode]["peak_before_bytes"] = _stats(device)[0]
        try:
            for _ in range(args.steps):
                t1 = time.perf_counter()
                loss, state = compiled[mode](state, data)
                losses.append(float(loss))
                times.append(time.perf_counter() - t1)
        except Exception as e:  # noqa: BLE001 -- running out of memory is a result
            if not harness.is_oom(e):
                raise
            modes[mode].update(oom=str(e).splitlines()[0][:300])
            _progress(f"mode {mode}: out of memory ({modes[mode]['oom']}); the modes after it "
                      "are not run")
            for later in order[order.index(mode) + 1:]:
                modes[later]["skipped"] = f"after mode {mode} ran out of memory"
            break
        peak = _stats(device)[0]
        modes[mode].update(losses=losses, step_s=harness.lower_median(times[1:] or times),
                           peak_bytes=peak)
        _progress(f"mode {mode}: {args.steps} steps, loss {losses[0]:.5f}, "
                  f"{modes[mode]['step_s']:.3f} s/step"
                  + (f", peak {peak / GiB:.2f} GiB" if peak is not None else ""))


_MODE_NAMES = {"0": "RECOMPUTE=0", "chunked": '`"full"` + `chunked_loss`'}


def format_report(result, budget_gib):
    cfg = result["config"]
    lines = [f"keras-hub {cfg['model']}-shaped CausalLM: {cfg['layers']} blocks, vocabulary "
             f"{cfg['vocab']}, {cfg['params'] / 1e9:.2f}B parameters in {cfg['dtype']}, LoRA rank "
             f"{cfg['rank']} ({cfg['lora_params']} trained, Adam, learning rate "
             f"{cfg['learning_rate']:g}), batch 1 x seq {cfg['seq']}, Keras's own train_step "
             f"(keras-hub's loss; chunk of {cfg['chunk_tokens'] or '-'} tokens), "
             f"on {cfg['device']} (JAX {cfg['jax']}, Keras {cfg['keras']})",
             f"state (weights, LoRA factors, Adam slots): {result['weights_bytes'] / GiB:.2f} GiB",
             "",
             f"| mode | XLA's plan (GiB) | peak of the allocator (GiB) | fits {budget_gib:g} GiB | "
             "s / step | losses |",
             "|---|---|---|---|---|---|"]
    note = False
    for mode, r in result["modes"].items():
        plan = f"{r['plan_bytes'] / GiB:.2f} (temporaries {r['temp_bytes'] / GiB:.2f})"
        if "oom" in r:
            peak, step, loss = "out of memory", "-", "-"
        elif "skipped" in r:
            peak, step, loss = "not run", "-", "-"
        elif "losses" not in r:  # a target's plan
            peak, step, loss = "-", "-", "-"
        else:
            peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / GiB:.2f}"
            if r.get("peak_bytes") is not None and r["peak_bytes"] == r.get("peak_before_bytes"):
                peak = f"<= {peak} (*)"
                note = True
            step, loss = f"{r['step_s']:.3f}", ", ".join(f"{v:.5f}" for v in r["losses"])
        used = r.get("peak_bytes") or r["plan_bytes"]
        fits = "yes" if used <= budget_gib * GiB else "no"
        name = _MODE_NAMES.get(mode, f'`"{mode}"`')
        lines.append(f"| {name} | {plan} | {peak} | {fits} | {step} | {loss} |")
    if note:
        lines += ["", "(*) the steps did not raise the allocator's peak: it was reached before them "
                      "(compiling: autotuning allocates on the device, or a smaller mode's steps), "
                      "so the step's own peak is at most this; XLA's plan is the closer figure."]
    if cfg.get("target"):
        lines += ["", f"XLA:GPU's plans for an {cfg['target']} target, compiled on this machine "
                      "(benchmarks.gpu_plan's target): nothing ran, no peak was measured."]
    elif not result["measurable"]:
        lines += ["", "No allocator statistics on this device (a CPU): XLA's plans only."]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = harness.parser(
        TOOL, "Peak memory of one whole LoRA training step of a keras-hub causal LM on JAX, "
              "without recomputation and with the policies of recompute.keras_hub.patch.")
    parser.add_argument("--model", choices=tuple(lm_memory.MODELS), default="gemma-7b",
                        help="widths of gemma-7b (default), gemma-2b, llama-7b, or tiny (tests)")
    parser.add_argument("--modes", type=harness.name_list(MODES), default=("0", "full", "chunked"),
                        help="comma-separated: 0 (RECOMPUTE=0), attention, full, chunked (full "
                             "with recompute.keras_hub.chunked_loss) (default 0,full,chunked)")
    parser.add_argument("--target", choices=tuple(gpu_plan.TARGETS), default=None,
                        help="plan the step for this GPU (XLA:GPU's plan, compiled here; "
                             "nothing runs) instead of running it on the local device")
    parser.add_argument("--chunk-tokens", type=harness.positive_int, default=None,
                        help="tokens per chunk of the chunked mode (default: the library's)")
    for flag, kind, default, text in (
            ("--seq", harness.positive_int, 8192, "sequence length"),
            ("--layers", harness.positive_int, None, "decoder blocks (default: the model's)"),
            ("--vocab", harness.positive_int, None, "vocabulary (default: the model's)"),
            ("--rank", harness.positive_int, 8, "LoRA rank"),
            ("--steps", harness.positive_int, 3, "steps per mode"),
            ("--dropout", harness.fraction, 0.0, "dropout rate (Gemma's presets: 0)"),
            ("--learning-rate", harness.non_negative_float, 0.0,
             "Adam's learning rate (0: the weights stay, so the losses of all modes are equal)"),
            ("--budget-gib", harness.positive_float, 24.0, "the card whose fit is reported, GiB")):
        parser.add_argument(flag, type=kind, default=default,
                            help=text if default is None else f"{text} (default {default:g})")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="Keras dtype policy of the model (default bfloat16)")
    harness.add_output_arguments(parser, TOOL, workers=False)
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "jax" and not args.target:
        parser.error("this tool runs on Keras's JAX backend (set KERAS_BACKEND=jax). "
                     f"Received: KERAS_BACKEND={backend}")
    harness.check_docs_page(parser, args.docs, TOOL, block=docs_block(args))
    harness.check_json_folder(parser, args)
    return args


def docs_block(args):
    return f"{TOOL} {args.model}"


def main(argv=None):
    args = parse_args(argv)
    if args.target:
        gpu_plan.prepare_environment()
    result = measure(args)
    with harness.report_to_docs(args.docs, TOOL, argv, block=docs_block(args)):
        print(format_report(result, args.budget_gib))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        _progress(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
