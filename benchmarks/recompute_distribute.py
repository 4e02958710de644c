"""Activation memory per replica of `recompute_grad` under `tf.distribute`, off vs on.

    python -m benchmarks.recompute_distribute             # 2 workers, 6 blocks x 256, seq 128 (~1.5 min)
    python -m benchmarks.recompute_distribute --quick     # tiny shape (~1 min, mostly start-up)
    python -m benchmarks.recompute_distribute --strategy mirrored
    python -m benchmarks.recompute_distribute --layers 12 --json out.json

The model is `benchmarks.encoder`'s transformer encoder (the one of `recompute_memory`: post-LN blocks with
self-attention, GELU FFN and dropout, each block's `call` decorated; Adam), at
a smaller default shape. It is trained with a custom loop (`strategy.run` in
`tf.function`: forward, backward, all-reduce of the gradients, update), once
with `RECOMPUTE=0` and once with `RECOMPUTE=1`, each in fresh processes, at
every per-replica batch size of `--batch-sizes`:

- `--strategy mwms` (default): `MultiWorkerMirroredStrategy`, 2 worker
  processes on loopback (`TF_CONFIG` on 127.0.0.1, free ports; one CPU device
  and one intra-op thread each). Each process is one replica with its own CPU
  allocator, so its figures are exactly one replica's.
- `--strategy mirrored`: `MirroredStrategy` on 2 logical CPU devices in one
  process. Logical CPU devices share one allocator (and one RSS), so the
  figures are both replicas' together; the per-replica column is half.

Measured per replica, for each batch size (median of `--steps` steps after two
of warm-up): the activation memory of a step -- TensorFlow's CPU allocator peak
during the step (`tf.config.experimental.get_memory_info`) minus its `current`
bytes just before it (stats reset before the step) -- and the CPU seconds per
step; per process, the peak RSS (VmHWM). The per-sample activation memory per
replica is the slope between the batch sizes (fixed costs -- the gradients,
their all-reduce buffers, the optimizer's temporaries -- cancel), and the
report gives the ratio off/on measured in the same run.

Figures (2 CPU cores shared with other jobs; default shape, per-replica batches
12 and 24; the loss of each step is the same off and on):

| run | MiB/sample/replica, off | on | off/on | at batch 24: MiB/replica, off -> on | CPU time on/off |
|---|---|---|---|---|---|
| `python -m benchmarks.recompute_distribute` (MWMS; worker 0, worker 1) | 19.86, 19.78 | 3.94, 3.74 | x5.04 | 477.0 -> 118.5 (x4.03) | x1.24, x1.33 |
| `... --strategy mirrored` (half of the shared allocator) | 18.84 | 4.27 | x4.42 | 463.9 -> 119.3 (x3.89) | x1.37, x1.33 |
| `... --layers 12` (MWMS; worker 0, worker 1) | 38.47, 38.23 | 4.26, 4.69 | x9.03 | 923.8 -> 147.0 (x6.28) | x1.14, x1.33 |

A replica saves what a single device saves: `python -m benchmarks.recompute_memory
--layers 6 --hidden 256 --heads 4 --ffn 1024 --seq 128 --vocab 8000
--batch-sizes 12,24` gives 20.2 -> 5.0 MiB/sample (x4.0) on one device. Peak
RSS per process moves less (x1.27 MWMS, x1.44 mirrored, x1.46 at 12 blocks):
about 1.1 GiB of it is TensorFlow's runtime. With 2 replicas sharing one
executor (mirrored), recomputation saved only x1.50 (13.2 MiB/sample/replica)
until a block's input gradients were made to wait for its weight gradients
(see `recompute.engine._core._after`): the executor ran the input gradients of one
replica ahead while the other replica's work kept its weight-gradient ops
waiting, and the recomputed activations of several blocks stayed alive.
At the smallest batches the "on" peak is set by fixed costs (the gradients
and their all-reduce), not by activations; the per-sample slope then reads
near zero, and the report says so.
"""

import json
import os
import sys
import time

from . import encoder, harness
from .harness import MiB

DEFAULT = dict(layers=6, hidden=256, heads=4, ffn=1024, seq=128, vocab=8000,
               batch_sizes=(12, 24), steps=3, dropout=0.1)
QUICK = dict(layers=3, hidden=64, heads=2, ffn=256, seq=64, vocab=500,
             batch_sizes=(16, 32), steps=2, dropout=0.1)
TOOL = "benchmarks.recompute_distribute"
_progress = harness.Progress(TOOL)


# --------------------------------------------------------------------------
# Worker: one replica (mwms) or two (mirrored), one RECOMPUTE setting.


def run_worker(cfg, strategy_name, batch_sizes, steps, out_path):
    strategy, task = _start_strategy(strategy_name)
    import tensorflow as tf
    import keras

    import recompute

    mode = os.environ.get(recompute.ENV_VAR, "")
    local_replicas = len(strategy.extended.worker_devices)
    tag = f"RECOMPUTE={mode} worker {task}"
    _progress(f"{tag}: building the model ({strategy.num_replicas_in_sync} replicas, "
              f"{local_replicas} in this process)")
    with strategy.scope():
        model, optimizer, _ = encoder.build_model(cfg)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    n_params = int(sum(int(tf.size(v)) for v in model.trainable_variables))

    rng = tf.random.Generator.from_seed(1000 * task + 1)
    result = dict(recompute=mode, recompute_enabled=recompute.is_enabled(), task=task,
                  local_replicas=local_replicas, params=n_params, batches={})
    for batch in sorted(batch_sizes):
        step = _make_step(strategy, model, optimizer, loss_fn, batch * strategy.num_replicas_in_sync)

        def batch_values():
            return _batch_values(strategy, rng, cfg, batch)

        def run(ids, labels):
            losses = strategy.experimental_local_results(step(ids, labels))
            return float(sum(float(v) for v in losses) / len(losses))

        result["batches"][str(batch)] = _measure_batch(
            run, batch_values, steps, f"{tag} batch {batch}/replica", local_replicas)
    result["rss_hwm_bytes"] = harness.peak_rss_kib() * 1024
    harness.write_result(out_path, result)
    harness.hold_then_exit()  # until the parent has every worker's result


def _start_strategy(strategy_name):
    """TensorFlow's threads and devices for `strategy_name`, then the strategy: (strategy,
    this worker's task index)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    if strategy_name == "mirrored":
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
    else:
        tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    import keras  # noqa: F401 (Keras and recompute loaded before the strategy, as always)

    import recompute  # noqa: F401

    if strategy_name == "mirrored":
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), 0
    return tf.distribute.MultiWorkerMirroredStrategy(), harness.task_index()


def _make_step(strategy, model, optimizer, loss_fn, global_batch):
    """The compiled distributed train step of `model` at `global_batch` examples."""
    import tensorflow as tf

    def replica_step(ids, labels):
        with tf.GradientTape() as tape:
            per_example = loss_fn(labels, model(ids, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(ids, labels):
        return strategy.run(replica_step, args=(ids, labels))

    return step


def _batch_values(strategy, rng, cfg, batch):
    """Each replica of this process gets its own [batch, seq] ids and labels."""
    import tensorflow as tf

    def per_replica(_):
        return (rng.uniform([batch, cfg["seq"]], 0, cfg["vocab"], dtype=tf.int32),
                rng.uniform([batch], 0, 2, dtype=tf.int32))

    if len(strategy.extended.worker_devices) == 1:
        return per_replica(None)
    ids = strategy.experimental_distribute_values_from_function(lambda c: per_replica(c)[0])
    labels = strategy.experimental_distribute_values_from_function(lambda c: per_replica(c)[1])
    return ids, labels


def _measure_batch(run, batch_values, steps, tag, local_replicas):
    """`run(*batch_values())` traced and warmed up, then measured over `steps` steps: the
    result of one batch size."""
    t0 = time.process_time()
    run(*batch_values())  # trace + first step (creates the slots)
    run(*batch_values())
    _progress(f"{tag}: traced and warmed up in "
              f"{time.process_time() - t0:.1f} CPU s; measuring {steps} step(s)")
    activations, cpu, wall, losses = [], [], [], []
    for _ in range(steps):
        ids, labels = batch_values()
        loss, activation, cpu_s, wall_s = harness.allocator_step(lambda: run(ids, labels))
        losses.append(loss)
        cpu.append(cpu_s)
        wall.append(wall_s)
        activations.append(activation)
    activation = harness.lower_median(activations)
    _progress(f"{tag}: activation memory "
              f"{activation / MiB / local_replicas:.1f} MiB per replica; "
              f"{sum(cpu) / len(cpu):.2f} CPU s/step")
    return dict(
        activation_bytes=int(activation), activation_bytes_per_step=[int(a) for a in activations],
        cpu_s_per_step=sum(cpu) / len(cpu), wall_s_per_step=sum(wall) / len(wall), loss=losses[0],
    )


# --------------------------------------------------------------------------
# Parent: spawn the workers, summarise.


def _spawn(cfg, strategy_name, mode, batch_sizes, steps, timeout):
    """Runs one RECOMPUTE setting in fresh processes (2 workers, or 1 for mirrored)."""
    processes = 1 if strategy_name == "mirrored" else 2
    envs = harness.tf_config_envs(processes) if strategy_name == "mwms" else [dict(TF_CONFIG=None)]
    argv = ["--strategy", strategy_name, "--batch-sizes", ",".join(map(str, batch_sizes)),
            "--steps", str(steps), *encoder.shape_argv(cfg)]
    _progress(f"RECOMPUTE={mode}: starting {processes} fresh process(es)")
    envs = [dict(env, **harness.allocator_env(), RECOMPUTE=mode, CUDA_VISIBLE_DEVICES="")
            for env in envs]
    runs = harness.run_workers(_progress, argv, envs, timeout=timeout)
    results = harness.require_results(runs, f"RECOMPUTE={mode}", timeout)
    return sorted(results, key=lambda r: r["task"])


def summarize(runs, batch_sizes):
    """Per-replica figures of each setting (worker 0's; mirrored: half of the process's)."""
    summary = {}
    for mode, workers in runs.items():
        per_worker = []
        for w in workers:
            share = 1.0 / w["local_replicas"]
            activation = {b: w["batches"][str(b)]["activation_bytes"] * share for b in batch_sizes}
            slope, intercept = harness.slope(list(activation.items()))
            per_worker.append(dict(
                activation_bytes_per_replica={str(b): a for b, a in activation.items()},
                per_sample_bytes_per_replica=slope, fixed_bytes_per_replica=intercept,
                rss_hwm_bytes_per_process=w["rss_hwm_bytes"],
                cpu_s_per_step={str(b): w["batches"][str(b)]["cpu_s_per_step"] for b in batch_sizes},
                loss={str(b): w["batches"][str(b)]["loss"] for b in batch_sizes},
            ))
        summary[mode] = per_worker
    ratios = {}
    if "0" in summary and "1" in summary:
        off, on = summary["0"][0], summary["1"][0]
        top = str(max(batch_sizes))
        ratios = dict(
            # None: with recomputation on, the step's peak did not grow with the
            # batch -- a fixed cost (gradients, all-reduce buffers) set it at
            # these batch sizes; larger ones measure the activations.
            per_sample_off_over_on=(
                off["per_sample_bytes_per_replica"] / on["per_sample_bytes_per_replica"]
                if on["per_sample_bytes_per_replica"] > 0 else None),
            activation_off_over_on_at_largest_batch=(
                off["activation_bytes_per_replica"][top] / on["activation_bytes_per_replica"][top]),
            rss_off_over_on=off["rss_hwm_bytes_per_process"] / on["rss_hwm_bytes_per_process"],
            cpu_on_over_off={b: on["cpu_s_per_step"][b] / off["cpu_s_per_step"][b]
                             for b in off["cpu_s_per_step"]},
        )
    return summary, ratios


def print_report(cfg, strategy_name, runs, summary, ratios, out=None):
    out = sys.stdout if out is None else out  # the current one: report_to_docs redirects it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    first = next(iter(runs.values()))[0]
    where = ("MultiWorkerMirroredStrategy, 2 worker processes on loopback (1 replica each)"
             if strategy_name == "mwms" else
             "MirroredStrategy, 2 logical CPUs in 1 process (shared allocator: per replica = half)")
    p(f"recompute under tf.distribute: {where}")
    p(f"{cfg['layers']} blocks, hidden {cfg['hidden']}, {cfg['heads']} heads, FFN {cfg['ffn']}, "
      f"seq {cfg['seq']}, vocab {cfg['vocab']}, dropout {cfg['dropout']}, Adam; "
      f"{first['params'] / 1e6:.2f}M parameters")
    p("")
    p(f"{'RECOMPUTE':>9} {'worker':>6} {'batch/replica':>13} {'activation MiB/replica':>23} "
      f"{'CPU s/step':>11} {'loss':>8}")
    per_worker = [(mode, task, s) for mode, workers in summary.items() for task, s in enumerate(workers)]
    for mode, task, s in per_worker:
        for b, a in s["activation_bytes_per_replica"].items():
            p(f"{mode:>9} {task:>6} {b:>13} {a / MiB:>23.1f} {s['cpu_s_per_step'][b]:>11.2f} "
              f"{s['loss'][b]:>8.4f}")
    p("")
    p(f"{'RECOMPUTE':>9} {'worker':>6} {'MiB/sample/replica':>19} {'fixed MiB':>10} "
      f"{'peak RSS MiB/process':>21}")
    for mode, task, s in per_worker:
        p(f"{mode:>9} {task:>6} {s['per_sample_bytes_per_replica'] / MiB:>19.2f} "
          f"{s['fixed_bytes_per_replica'] / MiB:>10.1f} {s['rss_hwm_bytes_per_process'] / MiB:>21.1f}")
    if ratios:
        p("")
        per_sample = ratios["per_sample_off_over_on"]
        p("activation memory per sample per replica, off/on:    " + (
            f"x{per_sample:.2f}" if per_sample is not None else
            "n/a (with RECOMPUTE=1 a fixed cost set the peak: use larger --batch-sizes)"))
        p(f"activation memory per replica at the largest batch:  "
          f"x{ratios['activation_off_over_on_at_largest_batch']:.2f}")
        p(f"peak RSS per process, off/on:                        x{ratios['rss_off_over_on']:.2f}")
        times = ", ".join(f"batch {b}: x{v:.2f}" for b, v in ratios["cpu_on_over_off"].items())
        p(f"CPU time per step, on/off:                           {times}")


# --------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
    parser = harness.parser(
        "benchmarks.recompute_distribute",
        "Per-replica activation memory of a transformer encoder trained under "
        "tf.distribute with RECOMPUTE=0 vs RECOMPUTE=1 (fresh processes each).",
    )
    parser.add_argument("--strategy", choices=("mwms", "mirrored"), default="mwms",
                        help="mwms: 2 MultiWorkerMirroredStrategy processes on loopback (default); "
                             "mirrored: MirroredStrategy on 2 logical CPUs in one process")
    encoder.add_shape_arguments(
        parser, DEFAULT, steps_help="measured steps after warm-up",
        batch_help="comma-separated per-replica batch sizes; the per-sample memory is "
                   f"the slope between them (default {','.join(map(str, DEFAULT['batch_sizes']))})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shape (3 blocks, hidden 64, seq 64; batches 16, 32): a smoke run; "
                             "explicit options override it")
    parser.add_argument("--timeout", type=harness.positive_float, default=1800.0,
                        help="seconds per RECOMPUTE setting before the workers are killed")
    harness.add_output_arguments(parser, TOOL)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)
    encoder.finish_shape_arguments(parser, args, QUICK if args.quick else DEFAULT,
                                   need_slope=not args.worker)
    if args.worker and not args.out:
        parser.error("--worker needs --out")
    harness.check_json_folder(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = encoder.shape_config(args)
    if args.worker:
        run_worker(cfg, args.strategy, args.batch_sizes, args.steps, args.out)
        return 0
    batch_sizes = sorted(args.batch_sizes)
    start = time.perf_counter()
    try:
        runs = {mode: _spawn(cfg, args.strategy, mode, batch_sizes, args.steps, args.timeout)
                for mode in ("0", "1")}
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary, ratios = summarize(runs, batch_sizes)
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    with harness.report_to_docs(args.docs, TOOL, argv):
        print_report(cfg, args.strategy, runs, summary, ratios)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(config=dict(cfg, strategy=args.strategy, batch_sizes=batch_sizes,
                                       steps=args.steps), runs=runs, summary=summary, ratios=ratios),
                      f, indent=2)
        _progress(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
