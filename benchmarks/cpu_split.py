"""Where a training step's CPU time goes: user and system time, page faults, per sample.

    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m benchmarks.cpu_split \\
        --layers 2 --modes 0,block --batch-sizes 6,43
    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m benchmarks.cpu_split \\
        --layers 2 --modes 0,block --batch-sizes 6,43 --malloc hugepages

The model is `benchmarks.batchfit`'s (bert4keras BERT of the `--shape`, here
with `--layers` Transformer blocks, a CLS -> Dense(2) head, tf_keras Adam,
dropout 0.1, random token ids with padding), trained with `train_on_batch`
at each mode (`0`: RECOMPUTE=0; a policy of `recompute.bert4keras.patch`)
and batch, each configuration in a fresh process. After one untimed step it
times `--steps` steps and reports per sample: user and system CPU seconds
(`getrusage`, microseconds, all threads), minor page faults (`getrusage`) and wall
seconds, the mean over the steps, and the process's peak RSS.

`--paired 0:6,block:43` times several configurations in one process
instead, a step of each in turn for `--steps` rounds: on these shared cores
the load moves between processes started minutes apart (RECOMPUTE=0 at
batch 6 has measured 5.0 to 8.4 CPU s per sample in separate runs), and the
configurations of one round run under the same load, so the ratio of one
round to the next moves less than the times. Each configuration is its own
model, built under its policy and traced with recomputation on or off
(`recompute.recompute_scope`); the peak RSS is then the process's.

Why: on CPU, TensorFlow takes each tensor from glibc's malloc, which maps a
block larger than its threshold (at most 32 MiB) afresh for each tensor and
unmaps it when the tensor dies, so the kernel faults in and zeroes every
page of every large tensor on every step. That is system time, and it grows
with the batch (more tensors pass the threshold), so CPU time per sample at
two different batch sizes -- "what batch fits?" compares RECOMPUTE=0 at its
largest batch with a policy at its own -- differs by more than the
recomputation. `--malloc hugepages` (see `harness.malloc_env`) shows the
same step with transparent huge pages, `--malloc tf-bfc` with TensorFlow's
own pool, which faults each page in once per process. Figures:
docs/batchfit.md.
"""

import argparse
import json
import os
import resource
import sys
import time

from . import batchfit, harness

TOOL = "benchmarks.cpu_split"
_progress = harness.Progress(TOOL)
MODES = ("0",) + batchfit.POLICIES


def _traced(args, mode, batch):
    """A configuration's model, built under its policy and traced with recomputation on
    or off by its first step (not timed), and the batches of its timed steps."""
    import recompute
    import recompute.bert4keras

    recompute.bert4keras.patch(policy=batchfit.policy_of(mode) or "block")
    shape = dict(batchfit.SHAPES[args.shape], layers=args.layers)
    model = batchfit.compiled_classifier(dict(shape=shape, seq_len=args.seq_len, accum_steps=1))
    batches = batchfit._random_batches(args.steps + 1, batch, args.seq_len, shape["vocab"], seed=batch)
    with recompute.recompute_scope(mode != "0"):  # baked into the traced step
        model.train_on_batch(*batches[0])
    return model, batches[1:]


def run_worker(args):
    """One configuration (`args.modes[0]`, `args.batch_sizes[0]`): writes its result to `args.out`."""
    mode, batch = args.modes[0], args.batch_sizes[0]
    model, batches = _traced(args, mode, batch)
    steps = [_timed_step(model, x, y, batch) for x, y in batches]
    harness.write_result(args.out, dict(
        mode=mode, batch=batch, layers=args.layers, shape=args.shape, seq_len=args.seq_len,
        malloc=harness.malloc_setting(), steps=steps, peak_rss_mib=harness.peak_rss_kib() / 1024.0,
        **_mean_steps(steps)))


def _timed_step(model, x, y, batch):
    """One `train_on_batch`: user, system, wall seconds and minor faults per sample."""
    # getrusage, not os.times: os.times counts in clock ticks (10 ms), and a tiny
    # step can take less than one, which read as 0 CPU seconds (and a ratio to 0).
    w0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    model.train_on_batch(x, y)
    w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return dict(user=(r1.ru_utime - r0.ru_utime) / batch, sys=(r1.ru_stime - r0.ru_stime) / batch,
                wall=(w1 - w0) / batch,
                minflt=(r1.ru_minflt - r0.ru_minflt) / batch)


def _mean_steps(steps):
    return {f"{k}_per_sample": sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def run_paired_worker(args):
    """`args.paired` in one process, a step of each in turn: writes the rounds to `args.out`."""
    models = []
    for mode, batch in args.paired:
        _progress(f"{mode} batch {batch}: building and tracing ...")
        models.append(_traced(args, mode, batch))
    rounds = []
    for i in range(args.steps):
        rounds.append([_timed_step(model, *batches[i], batch)
                       for (model, batches), (_, batch) in zip(models, args.paired)])
        _progress(f"round {i + 1} of {args.steps}: CPU s per sample "
                  + ", ".join(f"{m}@{b} {s['user'] + s['sys']:.3f}"
                              for (m, b), s in zip(args.paired, rounds[-1])))
    harness.write_result(args.out, dict(
        paired=[list(c) for c in args.paired], layers=args.layers, shape=args.shape,
        seq_len=args.seq_len, malloc=harness.malloc_setting(), rounds=rounds,
        peak_rss_mib=harness.peak_rss_kib() / 1024.0))


def measure_paired(args):
    _progress(f"{args.shape} x{args.layers} seq {args.seq_len}: "
              + ", ".join(f"{m}@{b}" for m, b in args.paired)
              + f" in one fresh process, {args.steps} rounds ...")
    return _run_worker(args, ["--paired", ",".join(f"{m}:{b}" for m, b in args.paired)], {},
                       f"{TOOL} paired worker")


def paired_summary(result):
    """Per configuration: the mean of its rounds (`*_per_sample`, as unpaired) and, for
    each after the first, the CPU time ratio to the first in each round and their median."""
    rounds = result["rounds"]
    cpu = [[s["user"] + s["sys"] for s in r] for r in rounds]
    rows = []
    if any(r[0] <= 0 for r in cpu):
        raise RuntimeError(
            f"{TOOL}: the first configuration ({result['paired'][0][0]}) measured 0 CPU seconds "
            "in a round, so no ratio to it exists; time a larger step (--seq-len, --layers or "
            f"its batch). Received: rounds' CPU seconds per sample {cpu}")
    for j, (mode, batch) in enumerate(result["paired"]):
        ratios = [r[j] / r[0] for r in cpu]
        rows.append(dict(mode=mode, batch=batch, layers=result["layers"],
                         peak_rss_mib=result["peak_rss_mib"],
                         **_mean_steps([r[j] for r in rounds]),
                         round_ratios=ratios, median_ratio=harness.lower_median(ratios)))
    return rows


def measure(args, mode, batch):
    _progress(f"{args.shape} x{args.layers} seq {args.seq_len} mode {mode} batch {batch}: "
              "measuring in a fresh process ...")
    return _run_worker(args, ["--modes", mode, "--batch-sizes", str(batch)],
                       dict(RECOMPUTE="0" if mode == "0" else "1"),
                       f"{TOOL} worker mode={mode} batch={batch}")


def _run_worker(args, configuration, env, what):
    """Runs one worker for `configuration` (its command-line options) with this run's
    shape, steps and `--malloc`, and `env` on top of `batchfit.ENV`; returns its result."""
    argv = ["--shape", args.shape, "--layers", str(args.layers), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), *configuration]
    env = dict(batchfit.ENV, CUDA_VISIBLE_DEVICES="", **env, **harness.malloc_env(args.malloc))
    result, = harness.require_results(harness.run_workers(_progress, argv, [env]), what)
    return result


def print_report(args, rows, out=None):
    """The table of `rows`: per configuration and sample, the CPU split and, with
    `--paired`, each round's CPU ratio to the first configuration (else the peak RSS)."""
    out = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=out)  # noqa: E731
    first = rows[0]
    how = (f"one process, {args.steps} rounds of a step per configuration" if args.paired
           else f"mean of {args.steps} steps")
    p(f"CPU time per sample of a bert4keras BERT ({args.shape} shape, {args.layers} blocks, seq "
      f"{args.seq_len}), tf_keras Adam, train_on_batch; {how}; "
      f"CPU allocation: {args.malloc} (--malloc)")
    p("")
    last = (f" CPU x {first['mode']}@{first['batch']} per round (median)" if args.paired
            else f"{'peak MiB':>9}")
    header = (f"{'mode':>15} {'batch':>5} {'user s':>7} {'sys s':>7} {'CPU s':>7} {'wall s':>7} "
              f"{'faults':>8} {last}")
    p(header)
    p("-" * len(header))
    for r in rows:
        if not args.paired:
            last = f"{r['peak_rss_mib']:>9.0f}"
        elif r is first:
            last = " -"
        else:
            last = (" " + " ".join(f"{x:.3f}" for x in r["round_ratios"])
                    + f" ({r['median_ratio']:.3f})")
        p(f"{r['mode']:>15} {r['batch']:>5} {r['user_per_sample']:>7.3f} {r['sys_per_sample']:>7.3f} "
          f"{r['user_per_sample'] + r['sys_per_sample']:>7.3f} {r['wall_per_sample']:>7.3f} "
          f"{r['minflt_per_sample'] / 1000:>7.0f}k {last}")
    if args.paired:
        p("")
        p(f"peak RSS of the process (every configuration): {first['peak_rss_mib']:.0f} MiB")


def _configs(text):
    """Type: comma-separated distinct MODE:BATCH pairs -> ((mode, batch), ...)."""
    expected = (f"comma-separated distinct MODE:BATCH pairs with MODE from {','.join(MODES)} "
                f"and BATCH a positive integer, such as 0:6,block:43")
    pairs = []
    for item in (t.strip() for t in text.split(",")):
        mode, _, batch = item.partition(":")
        if mode not in MODES or not batch.isdigit() or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        pairs.append((mode, int(batch)))
    if len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return tuple(pairs)


def parse_args(argv=None):
    parser = harness.parser(
        TOOL,
        "User and system CPU time, page faults and peak RSS per sample of a bert4keras "
        "BERT training step, per mode and batch (fresh processes).",
    )
    parser.add_argument("--shape", choices=tuple(batchfit.SHAPES), default="base",
                        help="model shape of benchmarks.batchfit (default base)")
    parser.add_argument("--layers", type=harness.positive_int,
                        help="Transformer blocks (default: the shape's)")
    parser.add_argument("--seq-len", type=harness.positive_int, default=512,
                        help="sequence length (default 512)")
    parser.add_argument("--modes", type=harness.name_list(MODES),
                        help=f"comma-separated, from {','.join(MODES)} (default 0,block)")
    parser.add_argument("--batch-sizes", type=harness.int_list,
                        help="comma-separated batch sizes (default 6,43)")
    parser.add_argument("--paired", type=_configs, metavar="MODE:BATCH,...",
                        help="time these configurations in one process, a step of each in "
                             "turn (e.g. 0:6,block:43; not with --modes or --batch-sizes)")
    parser.add_argument("--steps", type=harness.positive_int, default=3,
                        help="timed steps after the first (default 3); rounds with --paired")
    parser.add_argument("--json", metavar="PATH", help="save the results as JSON to PATH")
    harness.add_malloc_argument(parser)
    harness.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = batchfit.SHAPES[args.shape]["layers"]
    if args.paired and (args.modes or args.batch_sizes):
        parser.error("--paired names each configuration's mode and batch: leave out --modes "
                     "and --batch-sizes")
    args.modes = args.modes or ("0", "block")
    args.batch_sizes = args.batch_sizes or (6, 43)
    if args.worker and not args.paired and (not args.out or len(args.modes) != 1
                                            or len(args.batch_sizes) != 1):
        parser.error("--worker needs --out, one mode and one batch size")
    harness.check_json_folder(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        (run_paired_worker if args.paired else run_worker)(args)
        return 0
    try:
        if args.paired:
            rows = paired_summary(measure_paired(args))
        else:
            rows = [measure(args, mode, batch) for batch in args.batch_sizes for mode in args.modes]
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_report(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(options=vars(args), results=rows), f, indent=2)
        _progress(f"results saved to {os.path.abspath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
