"""Memory/time benchmark of `recompute_grad` on a BERT-base-shaped Keras 3 encoder.

    python -m benchmarks.recompute_memory            # full size: 12 x 768, seq 512 (slow)
    python -m benchmarks.recompute_memory --quick    # tiny shape, for CI
    python -m benchmarks.recompute_memory --layers 4 --seq 256 --json out.json

Every configuration (RECOMPUTE=0 or 1, one batch size) runs in a fresh
subprocess (`python -m benchmarks.recompute_memory --worker ...`), which builds
the model (`benchmarks.encoder`), traces and warms up one compiled training
step (`tf.function` with a `GradientTape` and `optimizer.apply`), and then
measures:

- activation memory: TensorFlow's CPU allocator peak during a step minus the
  allocator's `current` bytes just before it (stats reset before the step),
  the median over `--steps` steps after two warm-up steps (the workers get
  `TF_ENABLE_ONEDNN_OPTS=1` unless it is set: without oneDNN the CPU
  allocator keeps no statistics);
- peak RSS of the process (VmHWM);
- CPU seconds per step (`time.process_time`, all threads), mean of those steps.

Per-sample activation memory is the slope between the batch sizes (fixed costs
such as gradients and optimizer temporaries cancel). The parent prints a table
and the ratios: per-sample memory off/on, CPU time per step on/off.
Progress goes to stderr; `--json PATH` saves the results.
"""

import argparse
import json
import os
import sys
import time

from . import encoder, harness
from .harness import MiB

FULL = dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522,
            batch_sizes=(2, 6), steps=3, dropout=0.1)
QUICK = dict(layers=3, hidden=256, heads=4, ffn=1024, seq=128, vocab=1000,
             batch_sizes=(2, 6), steps=2, dropout=0.1)
TOOL = "benchmarks.recompute_memory"
_progress = harness.Progress(TOOL)


# --------------------------------------------------------------------------
# Worker: one configuration, one process.


def run_worker(cfg, batch, steps, out_path):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    import recompute

    mode = os.environ.get(recompute.ENV_VAR, "")
    tag = f"RECOMPUTE={mode} batch={batch}"
    _progress(f"{tag}: building the model")
    model, _, train_step = encoder.build_model(cfg)
    n_params = int(sum(int(tf.size(v)) for v in model.trainable_variables))

    # A fresh random batch (random labels) for every step: the loss stays
    # near log(2) instead of collapsing on a memorised batch.
    rng = tf.random.Generator.from_seed(batch)
    batches = [
        (rng.uniform([batch, cfg["seq"]], 0, cfg["vocab"], dtype=tf.int32),
         rng.uniform([batch], 0, 2, dtype=tf.int32))
        for _ in range(steps + 2)
    ]

    t0 = time.process_time()
    train_step(*batches[0]).numpy()  # trace + first step (creates the buffers)
    _progress(f"{tag}: traced and ran the first step in "
              f"{time.process_time() - t0:.1f} CPU s; warming up")
    train_step(*batches[1]).numpy()
    _progress(f"{tag}: measuring {steps} step(s)")

    # Each measured step: allocator stats reset just before it; its activation
    # memory is the allocator's peak during the step minus what was in use
    # before it. It varies from step to step by a few percent (the executor's
    # op order and the allocator's reuse of free chunks vary): the median is
    # reported, every step's value is in the JSON.
    activations, cpu, wall, losses = [], [], [], []
    for ids, labels in batches[2:]:
        loss, activation, cpu_s, wall_s = harness.allocator_step(
            lambda: float(train_step(ids, labels).numpy()))
        losses.append(loss)
        cpu.append(cpu_s)
        wall.append(wall_s)
        activations.append(activation)
    activation = harness.lower_median(activations)
    cpu_step = sum(cpu) / len(cpu)
    wall_step = sum(wall) / len(wall)
    result = dict(
        recompute=mode, recompute_enabled=recompute.is_enabled(), batch=batch,
        activation_bytes=int(activation), activation_bytes_per_step=[int(a) for a in activations],
        rss_hwm_bytes=harness.peak_rss_kib() * 1024, cpu_s_per_step=cpu_step,
        cpu_s_per_step_each=cpu, wall_s_per_step=wall_step, loss=losses[0], params=n_params,
    )
    _progress(f"{tag}: activation memory {activation / MiB:.1f} MiB "
              f"(median of steps: {', '.join(f'{a / MiB:.1f}' for a in activations)}); "
              f"{cpu_step:.2f} CPU s/step ({wall_step:.2f} s wall)")
    harness.write_result(out_path, result)


# --------------------------------------------------------------------------
# Parent: spawn the workers, summarise.


def _spawn(cfg, mode, batch, steps):
    _progress(f"RECOMPUTE={mode} batch={batch}: starting a fresh worker process")
    runs = harness.run_workers(
        _progress, ["--batch-sizes", str(batch), "--steps", str(steps), *encoder.shape_argv(cfg)],
        [dict(harness.allocator_env(), RECOMPUTE=mode)])
    return harness.require_results(runs, f"benchmark worker RECOMPUTE={mode} batch={batch}")[0]


def summarize(runs, modes, batch_sizes):
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["recompute"] == mode]
        slope, intercept = harness.slope([(r["batch"], r["activation_bytes"]) for r in mine])
        rss_slope, _ = harness.slope([(r["batch"], r["rss_hwm_bytes"]) for r in mine])
        summary[mode] = dict(
            per_sample_bytes=slope, fixed_bytes=intercept, rss_per_sample_bytes=rss_slope,
            cpu_s_per_step={str(r["batch"]): r["cpu_s_per_step"] for r in mine},
        )
    ratios = {}
    if "0" in summary and "1" in summary:
        off, on = summary["0"], summary["1"]
        ratios["memory_per_sample_off_over_on"] = (
            off["per_sample_bytes"] / on["per_sample_bytes"]
            if on["per_sample_bytes"] > 0 else float("inf")
        )
        ratios["rss_per_sample_off_over_on"] = (
            off["rss_per_sample_bytes"] / on["rss_per_sample_bytes"]
            if on["rss_per_sample_bytes"] > 0 else float("inf")
        )
        ratios["cpu_time_on_over_off"] = {
            str(b): on["cpu_s_per_step"][str(b)] / off["cpu_s_per_step"][str(b)]
            for b in batch_sizes
        }
    return summary, ratios


def print_report(cfg, runs, summary, ratios, out=sys.stdout):
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"recompute benchmark: {cfg['layers']} blocks, hidden {cfg['hidden']}, "
      f"{cfg['heads']} heads, FFN {cfg['ffn']}, seq {cfg['seq']}, vocab {cfg['vocab']}, "
      f"dropout {cfg['dropout']}, Adam; {runs[0]['params'] / 1e6:.1f}M parameters")
    p("")
    p(f"{'RECOMPUTE':>9} {'batch':>5} {'activation MiB':>15} {'peak RSS MiB':>13} "
      f"{'CPU s/step':>11} {'loss':>8}")
    for r in runs:
        p(f"{r['recompute']:>9} {r['batch']:>5} {r['activation_bytes'] / MiB:>15.1f} "
          f"{r['rss_hwm_bytes'] / MiB:>13.1f} {r['cpu_s_per_step']:>11.2f} {r['loss']:>8.4f}")
    p("")
    p(f"{'RECOMPUTE':>9} {'MiB/sample':>11} {'fixed MiB':>10} {'RSS MiB/sample':>15}")
    for mode, s in summary.items():
        p(f"{mode:>9} {s['per_sample_bytes'] / MiB:>11.1f} {s['fixed_bytes'] / MiB:>10.1f} "
          f"{s['rss_per_sample_bytes'] / MiB:>15.1f}")
    if ratios:
        p("")
        p(f"activation memory per sample, off/on: x{ratios['memory_per_sample_off_over_on']:.2f}")
        p(f"peak RSS per sample, off/on:          x{ratios['rss_per_sample_off_over_on']:.2f}")
        times = ", ".join(f"batch {b}: x{v:.3f}" for b, v in ratios["cpu_time_on_over_off"].items())
        p(f"CPU time per step, on/off:            {times}")


# --------------------------------------------------------------------------
# Command line.


_modes = harness.name_list(("0", "1"), expected="0, 1 or 0,1")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recompute_memory",
        description="Activation memory and CPU time of a BERT-base-shaped Keras 3 "
                    "encoder trained with RECOMPUTE=0 vs RECOMPUTE=1 (each "
                    "configuration in a fresh subprocess).",
    )
    encoder.add_shape_arguments(
        parser, FULL, steps_help="timed steps after warm-up",
        batch_help="comma-separated batch sizes; the per-sample memory is the "
                   "slope between them (default 2,6)")
    parser.add_argument("--modes", type=_modes, default=("0", "1"),
                        help="RECOMPUTE values to run (default 0,1)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shape (3 blocks, hidden 256, seq 128): about 30 s; "
                             "explicit options still override it")
    parser.add_argument("--json", metavar="PATH", help="save the results as JSON to PATH")
    harness.add_docs_argument(parser, TOOL)
    harness.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)

    encoder.finish_shape_arguments(parser, args, QUICK if args.quick else FULL,
                                   need_slope=not args.worker)
    if args.worker and (not args.out or len(args.batch_sizes) != 1):
        parser.error("--worker needs --out and exactly one batch size")
    if args.json:
        harness.existing_folder(parser, "--json", args.json)
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
    if args.worker:
        run_worker(cfg, args.batch_sizes[0], args.steps, args.out)
        return 0

    batch_sizes = sorted(args.batch_sizes)
    runs = []
    start = time.perf_counter()
    # Interleaved (off, on at each batch size) so that a change in the load of
    # the machine during the run does not bias the time ratio.
    for batch in batch_sizes:
        for mode in args.modes:
            runs.append(_spawn(cfg, mode, batch, args.steps))
    runs.sort(key=lambda r: (args.modes.index(r["recompute"]), r["batch"]))
    summary, ratios = summarize(runs, args.modes, batch_sizes)
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    with harness.report_to_docs(args.docs, TOOL, argv):
        print_report(cfg, runs, summary, ratios)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=dict(cfg, batch_sizes=batch_sizes, steps=args.steps),
                           runs=runs, summary=summary, ratios=ratios), f, indent=2)
        _progress(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
