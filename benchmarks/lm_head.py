"""The language-model head and loss, full logits against `recompute.keras_hub.chunked_loss`:
peak memory and CPU time of one training step on TensorFlow, paired in one process.

    python -m benchmarks.lm_head                       # Gemma-2B widths, 2 blocks, seq 2048
    python -m benchmarks.lm_head --model tiny --vocab 1000 --seq 64 --rounds 1   # seconds

Two copies of the same random-init keras-hub `GemmaCausalLM` (`benchmarks.lm_memory`'s
shapes; `--layers` blocks, the real vocabulary `--vocab`, float32, dropout 0, LoRA rank
`--rank`), each compiled by keras-hub's `compile` with Adam (keras-hub's loss:
`SparseCategoricalCrossentropy(from_logits=True)`, weighted accuracy), one of them then
`chunked_loss(...)` (`--chunk-tokens`, default the library's). Both train on the same random
batch of `--batch` sequences of `--seq` tokens with `train_on_batch`, RECOMPUTE=1 with
`patch()` (`"full"`: the blocks keep only their inputs, so the head is what differs). After a
warm-up step each, `--rounds` rounds run one step of each in turn; the table gives the median
of TensorFlow's CPU allocator peak of a step above what was alive before it
(`harness.allocator_step`), the median CPU seconds, and their ratio; the losses of the two
must agree (the chunked loss is exact).

Limits: TensorFlow only (the CPU allocator keeps statistics with TF_ENABLE_ONEDNN_OPTS=1,
which the tool sets before importing it); both models alive in one process (the peaks are
of a step, above what was alive: the other model's weights do not count).
"""

import os
import sys

from . import harness, lm_memory
from .harness import GiB

TOOL = "benchmarks.lm_head"
_progress = harness.Progress(TOOL)


def measure(args):
    import keras
    import numpy as np

    import recompute
    import recompute.keras_hub

    cfg = dict(layers=args.layers, seq=args.seq, vocab=args.vocab, rank=args.rank, dropout=0.0)
    models = {}
    for mode in ("full logits", "chunked"):
        _progress(f"building {mode}: {args.model} widths, {args.layers} blocks, vocabulary "
                  f"{args.vocab}, LoRA rank {args.rank}")
        lm, _ = lm_memory.causal_lm(cfg, args.model, "full")
        lm.compile(optimizer=keras.optimizers.Adam(1e-4))
        if mode == "chunked":
            recompute.keras_hub.chunked_loss(lm, chunk_tokens=args.chunk_tokens)
        models[mode] = lm
    x, y = lm_memory.jax_batch(args.batch, args.seq, args.vocab, 0)
    results = {mode: dict(peaks=[], cpu=[], losses=[]) for mode in models}

    def step(mode):
        loss, peak, cpu, _ = harness.allocator_step(
            lambda: models[mode].train_on_batch(x, y, return_dict=True)["loss"])
        return float(loss), peak, cpu

    with recompute.recompute_scope(True):
        for mode in models:  # warm-up: trace and first step
            _progress(f"{mode}: warm-up step")
            results[mode]["losses"].append(step(mode)[0])
        for r in range(args.rounds):
            for mode in models:
                loss, peak, cpu = step(mode)
                results[mode]["peaks"].append(peak)
                results[mode]["cpu"].append(cpu)
                results[mode]["losses"].append(loss)
                _progress(f"round {r + 1}/{args.rounds}, {mode}: peak {peak / GiB:.2f} GiB, "
                          f"{cpu:.1f} CPU s, loss {loss:.6f}")
    for r in results.values():
        r["peak"] = float(np.median(r["peaks"]))
        r["cpu_s"] = float(np.median(r["cpu"]))
    return results


def format_report(results, args):
    full, chunked = results["full logits"], results["chunked"]
    lines = [f"{args.model} widths, {args.layers} blocks, vocabulary {args.vocab}, seq {args.seq}, "
             f"batch {args.batch}, float32, LoRA rank {args.rank}, patch() full, RECOMPUTE=1; "
             f"{args.rounds} paired rounds (medians)", "",
             "| head and loss | step peak GiB | CPU s / step | losses |", "|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['peak'] / GiB:.2f} | {r['cpu_s']:.1f} | "
                     f"{', '.join(f'{v:.6f}' for v in r['losses'])} |")
    lines += ["", f"chunked saves {(full['peak'] - chunked['peak']) / GiB:.2f} GiB of the step's "
              f"peak at x{chunked['cpu_s'] / full['cpu_s']:.2f} the CPU time"]
    return "\n".join(lines)


def parse_args(argv=None):
    p = harness.parser(TOOL, __doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(lm_memory.MODELS), default="gemma-2b")
    p.add_argument("--layers", type=harness.positive_int, default=2)
    p.add_argument("--vocab", type=harness.positive_int, default=256000)
    p.add_argument("--seq", type=harness.positive_int, default=2048)
    p.add_argument("--batch", type=harness.positive_int, default=1)
    p.add_argument("--rank", type=harness.positive_int, default=8)
    p.add_argument("--chunk-tokens", type=harness.positive_int, default=None)
    p.add_argument("--rounds", type=harness.positive_int, default=3)
    harness.add_docs_argument(p, TOOL)
    args = p.parse_args(argv)
    harness.check_docs_page(p, args.docs, TOOL)
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.update(harness.allocator_env())
    sys.path.insert(0, harness.CHECKOUT)
    results = measure(args)
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(format_report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
