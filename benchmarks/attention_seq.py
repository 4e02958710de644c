"""Activation memory per sample against the sequence length, for each recomputation policy.

    python -m benchmarks.attention_seq                        # seq 512, 1024, 2048; 4 blocks
    python -m benchmarks.attention_seq --seqs 512,1024,2048,4096 --modes full,attention \\
        --plot docs/attention_seq.png --docs docs/attention.md

For every sequence length, runs `benchmarks.recompute_memory --model standard`
(the standard Keras 3 block: `MultiHeadAttention`, GELU FFN, dropout 0.1, at
BERT-base width: hidden 768, 12 heads, FFN 3072; `--layers` blocks) for the
modes asked (`0` = RECOMPUTE=0, `full`, `attention`), each configuration in a
fresh process (a vocabulary of 1000: the embedding's gradient is not what is
measured), and reads its per-sample activation memory (TensorFlow's
allocator, the slope between `--batch-sizes`). Prints one table -- MiB per
sample per mode and length, and each length's ratio to the shortest one's --
and draws it as a PNG (`--plot`; log-log axes, with the slopes of a linear and
a quadratic growth for reference). Where the memory per sample grows
linearly in seq, the attention's [seq, seq] tensors are not what is kept or
held; quadratic growth is the attention matrices.

A length whose configuration fails (out of memory: a worker is stopped past
`--rss-limit-gib` of resident memory) is reported as failed in its cell, not
a crash. Limits: CPU only (the TensorFlow backend's allocator); the batches
must be small at long sequences on a 24 GiB machine (default 1,2).
"""

import json
import os
import subprocess
import sys
import tempfile

from . import harness

TOOL = "benchmarks.attention_seq"
MODES = ("0", "full", "attention")
_progress = harness.Progress(TOOL)


def parse_args(argv=None):
    parser = harness.parser(
        TOOL,
        "Activation memory per sample of the standard Keras 3 block against the "
        "sequence length, per recomputation policy (each configuration in a fresh "
        "process, through benchmarks.recompute_memory).",
    )
    parser.add_argument("--seqs", type=harness.int_list, default=[512, 1024, 2048],
                        help="comma-separated sequence lengths (default 512,1024,2048)")
    parser.add_argument("--modes", type=harness.name_list(MODES), default=list(MODES),
                        help="comma-separated: 0 (RECOMPUTE=0), full, attention (default all)")
    parser.add_argument("--skip-off-above", type=harness.positive_int, default=2048,
                        help="run mode 0 only up to this length (default 2048: above it, "
                             "RECOMPUTE=0's attention matrices do not fit in 24 GiB)")
    parser.add_argument("--layers", type=harness.positive_int, default=4,
                        help="blocks (default 4)")
    parser.add_argument("--hidden", type=harness.positive_int, default=768,
                        help="hidden size (default 768)")
    parser.add_argument("--heads", type=harness.positive_int, default=12,
                        help="attention heads (default 12)")
    parser.add_argument("--ffn", type=harness.positive_int, default=3072,
                        help="FFN inner size (default 3072)")
    parser.add_argument("--batch-sizes", type=harness.int_list, default=[1, 2],
                        help="comma-separated batch sizes of the slope (default 1,2)")
    parser.add_argument("--steps", type=harness.positive_int, default=2,
                        help="measured steps per configuration (default 2)")
    parser.add_argument("--plot", metavar="PATH", help="write the PNG to PATH")
    harness.add_output_arguments(parser, TOOL, workers=False)
    args = parser.parse_args(argv)
    if len(args.batch_sizes) < 2:
        parser.error("`--batch-sizes` must list at least 2 batch sizes (the slope). "
                     f"Received: --batch-sizes={','.join(map(str, args.batch_sizes))}")
    if args.docs:
        harness.check_docs_page(parser, args.docs, TOOL)
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        if path:
            harness.existing_folder(parser, flag, path)
    return args


def measure(seq, modes, args):
    """{mode: MiB per sample or None (failed)} at `seq`, by one run of recompute_memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.recompute_memory", "--model", "standard",
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
               "--ffn", str(args.ffn), "--vocab", "1000", "--seq", str(seq), "--modes", ",".join(modes),
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--steps", str(args.steps),
               "--json", out]
        _progress(f"seq {seq}: {' '.join(cmd[1:])}")
        done = subprocess.run(cmd, cwd=harness.CHECKOUT, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            _progress(f"seq {seq}: failed (exit code {done.returncode})")
            return {mode: None for mode in modes}
        with open(out) as f:
            summary = json.load(f)["summary"]
    return {mode: summary[mode]["per_sample_bytes"] / harness.MiB for mode in modes}


def table(seqs, results, modes):
    first = seqs[0]
    lines = [f"{'seq':>6} " + " ".join(f"{m if m != '0' else 'RECOMPUTE=0':>14}" for m in modes)]
    for seq in seqs:
        cells = []
        for mode in modes:
            value = results[seq].get(mode)
            if value is None:
                cells.append(f"{'-' if mode not in results[seq] else 'failed':>14}")
                continue
            base = results[first].get(mode)
            growth = f" x{value / base:.1f}" if base and seq != first else ""
            cells.append(f"{value:>8.1f}{growth:>6}")
        lines.append(f"{seq:>6} " + " ".join(cells))
    return "\n".join(lines)


def plot(path, seqs, results, modes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    names = {"0": "RECOMPUTE=0", "full": '"full"', "attention": '"attention"'}
    for mode in modes:
        points = [(s, results[s][mode]) for s in seqs if results[s].get(mode)]
        if points:
            ax.plot(*zip(*points), marker="o", label=names[mode])
    start = min(s for s in seqs)
    ref = next((results[start][m] for m in ("full", "attention", "0") if results[start].get(m)), None)
    if ref:
        ax.plot(seqs, [ref * s / start for s in seqs], ":", color="grey", label="linear in seq")
        ax.plot(seqs, [ref * (s / start) ** 2 for s in seqs], "--", color="grey",
                label="quadratic in seq")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs)
    ax.set_xticklabels([str(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("activation MiB per sample")
    ax.set_title("Standard Keras 3 blocks (BERT-base width), TensorFlow, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _progress(f"plot written to {path}")


def main(argv=None):
    args = parse_args(argv)
    results = {}
    for seq in args.seqs:
        modes = [m for m in args.modes if m != "0" or seq <= args.skip_off_above]
        results[seq] = measure(seq, modes, args)
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(f"activation MiB per sample (x: against seq {args.seqs[0]}); standard Keras 3 "
              f"block x {args.layers}, hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, "
              f"dropout 0.1; "
              f"batches {','.join(map(str, args.batch_sizes))}; TensorFlow's CPU allocator\n")
        print(table(args.seqs, results, args.modes))
    if args.plot:
        plot(args.plot, args.seqs, results, args.modes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(s): r for s, r in results.items()}, f, indent=2)
    return 0 if all(v is not None for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
