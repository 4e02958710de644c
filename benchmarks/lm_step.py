"""Peak memory of one whole LoRA training step of a keras-hub causal LM on JAX, per policy.

    KERAS_BACKEND=jax python -m benchmarks.lm_step                  # Gemma-7B, bf16, seq 8192
    KERAS_BACKEND=jax python -m benchmarks.lm_step --model gemma-2b --seq 4096 --modes full
    KERAS_BACKEND=jax python -m benchmarks.lm_step --model tiny --seq 64 --vocab 1000  # seconds

`benchmarks.lm_memory` measures a few blocks and projects; this tool runs the
real model: every decoder block (`--layers`, default the model's), its real
vocabulary (`--vocab`, default the model's), weights in `--dtype` (default
bfloat16, Keras's dtype policy: weights and compute), random initialization,
`backbone.enable_lora(--rank)`, Adam over the LoRA factors, batch 1 of
`--seq` tokens (next-token cross-entropy on random ids), learning rate
`--learning-rate` (default 0: the step computes and applies everything --
gradients, Adam's slots, the update -- but the weights stay, so every mode
and step sees the same model and their losses must be equal: recomputation
is exact; a check the table shows, not only a measurement). The step is
`jax.jit` of `stateless_call` + `jax.value_and_grad` + the optimizer's
`stateless_apply`, with the whole state donated (so the step updates it in
place, as Keras's JAX trainer does).

Modes (`--modes`): `0` (RECOMPUTE off) and `full`/`attention`
(`recompute.keras_hub.patch(policy=...)`, recomputation on while the step is
traced: `recompute.recompute_scope`). The model is built once; each mode's
step is compiled ahead of time (`jax.jit(...).lower(...).compile()`), which
gives XLA's plan of its memory (`memory_analysis()`: arguments, outputs not
aliased to them, temporaries). Then the modes run in the order of their plans,
smallest first (the allocator's peak only grows), `--steps` steps each, and
the peak of the accelerator's allocator (`memory_stats()["peak_bytes_in_use"]`)
is read before and after each mode's steps (JAX cannot reset it: where the
steps did not raise it, the table says the step's peak is at most that --
compiling, whose autotuning allocates on the device, can reach it first). A mode that runs out of memory is reported as such,
with its plan; the modes after it are not run (the donated state is gone).
On a CPU (no allocator statistics) only the plans are reported.

Limits: batch 1; the peak includes the weights, the LoRA optimizer state and
everything XLA holds (its plan is the reference where the step does not run);
one process, so a mode's peak is measured after the smaller modes ran (their
peaks are lower, so they do not mask it).
"""

import json
import os
import sys
import time

from . import harness, lm_memory
from .harness import GiB

TOOL = "benchmarks.lm_step"
MODES = ("0", "attention", "full")
DTYPES = ("bfloat16", "float16", "float32")
_progress = harness.Progress(TOOL)


def plan_bytes(analysis):
    """XLA's plan of a compiled step (`memory_analysis()`): arguments + outputs not aliased to
    an argument + temporaries; None where the backend gives none."""
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def _stats(device):
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


def measure(args):
    """{config, weights, modes: {mode: {plan_bytes, temp_bytes, compile_s, peak_bytes,
    step_s, losses | oom}}} of `args`' model, every mode in this process."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    import recompute

    shape = lm_memory.MODELS[args.model]
    layers = args.layers or shape["blocks"]
    vocab = args.vocab or shape["vocab"]
    device = jax.devices()[0]
    keras.config.set_dtype_policy(args.dtype)
    t0 = time.perf_counter()
    _progress(f"building {args.model}: {layers} blocks, vocabulary {vocab}, {args.dtype}, "
              f"LoRA rank {args.rank}, on {device}")
    lm, n_params = lm_memory.causal_lm(dict(layers=layers, seq=args.seq, vocab=vocab,
                                            rank=args.rank, dropout=args.dropout),
                                       args.model, "full")
    optimizer = keras.optimizers.Adam(args.learning_rate)
    optimizer.build(lm.trainable_variables)
    state = ([v.value for v in lm.trainable_variables],
             [v.value for v in lm.non_trainable_variables],
             [v.value for v in optimizer.variables])
    weights = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in jax.tree.leaves(state))
    lora = sum(int(np.prod(v.shape)) for v in lm.trainable_variables)
    _progress(f"built in {time.perf_counter() - t0:.0f} s: {n_params / 1e9:.2f}B parameters, "
              f"{lora} LoRA; state {weights / GiB:.2f} GiB")
    x, y = jax.tree.map(jnp.asarray, lm_memory.jax_batch(1, args.seq, vocab, 0))

    def loss_fn(trainable, non_trainable, x, y):
        return lm_memory.jax_loss(lm, trainable, non_trainable, x, y)

    def make_step():  # one function per mode: jax.jit's trace cache does not see RECOMPUTE
        def step(state, x, y):
            trainable, non_trainable, slots = state
            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable, x, y)
            trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
            return loss, (trainable, non_trainable, slots)

        return step

    modes, compiled = {}, {}
    for mode in args.modes:
        t1 = time.perf_counter()
        with recompute.recompute_scope(mode != "0"):
            lowered = jax.jit(make_step(), donate_argnums=0).lower(state, x, y)
        compiled[mode] = lowered.compile()
        analysis = compiled[mode].memory_analysis()
        modes[mode] = dict(compile_s=round(time.perf_counter() - t1, 1),
                           plan_bytes=plan_bytes(analysis),
                           temp_bytes=None if analysis is None else int(analysis.temp_size_in_bytes))
        plan = modes[mode]["plan_bytes"]
        _progress(f"mode {mode}: compiled in {modes[mode]['compile_s']:.0f} s; XLA's plan "
                  + ("none" if plan is None else f"{plan / GiB:.2f} GiB"))
    order = sorted(args.modes, key=lambda m: modes[m]["plan_bytes"] or 0)
    measurable = _stats(device)[0] is not None
    for mode in order:
        losses, times = [], []
        modes[mode]["peak_before_bytes"] = _stats(device)[0]
        try:
            for _ in range(args.steps):
                t1 = time.perf_counter()
                loss, state = compiled[mode](state, x, y)
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
    return dict(config=dict(model=args.model, layers=layers, vocab=vocab, seq=args.seq, batch=1,
                            dtype=args.dtype, rank=args.rank, dropout=args.dropout,
                            learning_rate=args.learning_rate,
                            device=str(device), params=n_params, lora_params=lora,
                            jax=jax.__version__, keras=keras.__version__),
                weights_bytes=weights, measurable=measurable, modes=modes)


def format_report(result, budget_gib):
    cfg = result["config"]
    lines = [f"keras-hub {cfg['model']}-shaped CausalLM: {cfg['layers']} blocks, vocabulary "
             f"{cfg['vocab']}, {cfg['params'] / 1e9:.2f}B parameters in {cfg['dtype']}, LoRA rank "
             f"{cfg['rank']} ({cfg['lora_params']} trained, Adam, learning rate "
             f"{cfg['learning_rate']:g}), batch 1 x seq {cfg['seq']}, "
             f"on {cfg['device']} (JAX {cfg['jax']}, Keras {cfg['keras']})",
             f"state (weights, LoRA factors, Adam slots): {result['weights_bytes'] / GiB:.2f} GiB",
             "",
             f"| mode | XLA's plan (GiB) | peak of the allocator (GiB) | fits {budget_gib:g} GiB | "
             "s / step | losses |",
             "|---|---|---|---|---|---|"]
    note = False
    for mode, r in result["modes"].items():
        plan = "-" if r["plan_bytes"] is None else f"{r['plan_bytes'] / GiB:.2f}"
        if "oom" in r:
            peak, step, loss = "out of memory", "-", "-"
        elif "skipped" in r:
            peak, step, loss = "not run", "-", "-"
        else:
            peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / GiB:.2f}"
            if r.get("peak_bytes") is not None and r["peak_bytes"] == r.get("peak_before_bytes"):
                peak = f"<= {peak} (*)"
                note = True
            step, loss = f"{r['step_s']:.3f}", ", ".join(f"{v:.5f}" for v in r["losses"])
        used = r.get("peak_bytes") or r["plan_bytes"]
        fits = "-" if used is None else ("yes" if used <= budget_gib * GiB else "no")
        name = "RECOMPUTE=0" if mode == "0" else f'`"{mode}"`'
        lines.append(f"| {name} | {plan} | {peak} | {fits} | {step} | {loss} |")
    if note:
        lines += ["", "(*) the steps did not raise the allocator's peak: it was reached before them "
                      "(compiling: autotuning allocates on the device, or a smaller mode's steps), "
                      "so the step's own peak is at most this; XLA's plan is the closer figure."]
    if not result["measurable"]:
        lines += ["", "No allocator statistics on this device (a CPU): XLA's plans only."]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = harness.parser(
        TOOL, "Peak memory of one whole LoRA training step of a keras-hub causal LM on JAX, "
              "without recomputation and with the policies of recompute.keras_hub.patch.")
    parser.add_argument("--model", choices=tuple(lm_memory.MODELS), default="gemma-7b",
                        help="widths of gemma-7b (default), gemma-2b, llama-7b, or tiny (tests)")
    parser.add_argument("--modes", type=harness.name_list(MODES), default=("0", "full"),
                        help="comma-separated: 0 (RECOMPUTE=0), attention, full (default 0,full)")
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
    if backend != "jax":
        parser.error("this tool runs on Keras's JAX backend (set KERAS_BACKEND=jax). "
                     f"Received: KERAS_BACKEND={backend}")
    harness.check_docs_page(parser, args.docs, TOOL, block=docs_block(args))
    harness.check_json_folder(parser, args)
    return args


def docs_block(args):
    return f"{TOOL} {args.model}"


def main(argv=None):
    args = parse_args(argv)
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
