"""Benchmark: all-reduce traffic and step time of `AccumOptimizer` on 2 workers (loopback).

    python -m benchmarks.accum_distribute            # MLP of 1.6M parameters (6 MiB), k=8
    python -m benchmarks.accum_distribute --quick    # 0.15M parameters, k=4
    python -m benchmarks.accum_distribute --json out.json

Starts 2 processes of this module as `MultiWorkerMirroredStrategy` workers
(`TF_CONFIG` on 127.0.0.1, free ports, one CPU device and one intra-op thread
each; killed after `--timeout` seconds), which train the same Keras 3 MLP in a
custom loop (`strategy.run` in `tf.function`, per-worker micro-batch
`--micro-batch`) with three configurations, each on the same `k`
micro-batches per effective batch:

- `accum`: `AccumOptimizer(Adam, k)`: each worker accumulates locally, one
  all-reduce round per effective batch;
- `reduce_each`: the same `AccumOptimizer`, but the loop all-reduces the
  gradients of every micro-batch first (`ReplicaContext.all_reduce`, what
  accumulating after a data-parallel reduction does, like PyTorch DDP
  without `no_sync`) and passes each worker's `1/workers` share, so the
  updates are the same: `k` rounds per effective batch, plus the update's;
- `plain`: `Adam` at every micro-batch (`k` rounds and `k` updates; no
  accumulation, for reference).

Per effective batch, each worker reports the all-reduce rounds and bytes it
executed (counted at run time by `benchmarks.allreduce.AllReduceCounter`: bytes are one worker's
payload), the wall time and the process CPU time (all threads), medians over
`--batches` effective batches after one of warm-up. The configurations are
interleaved batch by batch, so load from other jobs hits them alike. The
table shows worker 0; both workers' figures go to `--json`.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

from . import harness
from .allreduce import AllReduceCounter
from .harness import MiB

TOOL = "benchmarks.accum_distribute"
_progress = harness.Progress(TOOL)

# ------------------------------------------------------------------ benchmark

CONFIGS = ("accum", "reduce_each", "plain")


def _make_model(keras, features, hidden, layers):
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((features,))
    for _ in range(layers):
        x = keras.layers.Dense(hidden, activation="tanh")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _worker(args):
    """One worker: trains each configuration, prints a JSON line of its measurements."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    from accum import AccumOptimizer

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    task = harness.task_index()
    k, b = args.k, args.micro_batch
    rng = np.random.default_rng(task)
    x = rng.normal(size=(k * b, args.features)).astype("float32")
    y = rng.normal(size=(k * b, 1)).astype("float32")
    runs = {}
    for config in CONFIGS:
        with strategy.scope():
            model = _make_model(keras, args.features, args.hidden, args.layers)
            inner = keras.optimizers.Adam(1e-4)
            optimizer = inner if config == "plain" else AccumOptimizer(inner, k)
            optimizer.build(model.trainable_variables)

        def replica_step(x, y, model=model, optimizer=optimizer, config=config):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=b * workers)
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            if config == "reduce_each":
                reduced = tf.distribute.get_replica_context().all_reduce("sum", grads)
                grads = [g / workers for g in reduced]
            optimizer.apply_gradients(zip(grads, variables))

        @tf.function
        def effective_batch(x, y, replica_step=replica_step):
            for i in range(k):  # unrolled: k micro-steps per call
                strategy.run(replica_step, args=(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]))

        counter = AllReduceCounter()
        with counter.counting():
            effective_batch(x, y)  # trace + warm-up
        runs[config] = (effective_batch, counter, model,
                        sum(int(np.prod(v.shape)) for v in model.trainable_variables))
    samples = {config: {"rounds": [], "bytes": [], "wall": [], "cpu": []} for config in CONFIGS}
    for _ in range(args.batches):
        for config, (fn, counter, model, _) in runs.items():
            counter.reset()
            wall, cpu = time.perf_counter(), time.process_time()
            fn(x, y)
            _ = model.trainable_variables[0].numpy()  # wait for the update
            samples[config]["wall"].append(time.perf_counter() - wall)
            samples[config]["cpu"].append(time.process_time() - cpu)
            samples[config]["rounds"].append(int(counter.rounds.numpy()))
            samples[config]["bytes"].append(int(counter.bytes.numpy()))
    out = {"task": task, "workers": workers}
    for config in CONFIGS:
        out[config] = {key: statistics.median(values) for key, values in samples[config].items()}
        out[config]["parameters"] = runs[config][3]
    harness.write_result(args.out, out)
    harness.hold_then_exit()  # until the parent has both workers' results


def run_workers(argv, workers=2, timeout=600.0):
    """Starts `workers` processes of this module (`--worker`), returns their results."""
    envs = [dict(env, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
            for env in harness.tf_config_envs(workers)]
    _progress(f"starting {workers} worker processes")
    runs = harness.run_workers(_progress, argv, envs, timeout=timeout)
    return sorted(harness.require_results(runs, "accum_distribute", timeout), key=lambda r: r["task"])


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    forwarded = ["--k", str(args.k), "--micro-batch", str(args.micro_batch), "--batches",
                 str(args.batches), "--features", str(args.features), "--hidden", str(args.hidden),
                 "--layers", str(args.layers)]
    try:
        results = run_workers(forwarded, timeout=args.timeout)
    except RuntimeError as e:  # a worker failed: its stderr tail is printed already
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    _print_report(args, results, argv)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("json", "out")}, "workers": results},
                      f, indent=2)
    return results


def parse_args(argv=None):
    """The command line, with the defaults of `--quick` or of a full run filled in."""
    parser = harness.parser(
        "benchmarks.accum_distribute",
        "All-reduce bytes and step time of AccumOptimizer on 2 workers on loopback.",
    )
    parser.add_argument("--quick", action="store_true", help="small MLP, k=4, 3 effective batches")
    parser.add_argument("--k", type=harness.positive_int, default=None,
                        help="steps_per_update (default 8; --quick 4)")
    parser.add_argument("--micro-batch", type=harness.positive_int, default=16,
                        help="per-worker micro-batch")
    parser.add_argument("--batches", type=harness.positive_int, default=None,
                        help="effective batches timed (default 5)")
    parser.add_argument("--timeout", type=harness.positive_float, default=600.0)
    harness.add_output_arguments(parser, TOOL)
    parser.add_argument("--features", type=harness.positive_int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=harness.positive_int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=harness.positive_int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and not args.out:
        parser.error("--worker needs --out")
    harness.check_docs_page(parser, args.docs, TOOL)
    quick = args.quick
    args.k = args.k or (4 if quick else 8)
    args.batches = args.batches or (3 if quick else 5)
    args.features = args.features or (64 if quick else 512)
    args.hidden = args.hidden or (256 if quick else 1024)
    args.layers = args.layers or (3 if quick else 2)
    return args


def _print_report(args, results, argv):
    """Worker 0's measurements, a row per configuration (and into the docs page with `--docs`)."""
    w0 = results[0]
    params = w0["accum"]["parameters"]
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(f"2 workers (MultiWorkerMirroredStrategy, loopback), MLP {params / 1e6:.2f}M parameters "
              f"({params * 4 / MiB:.1f} MiB float32), k={args.k}, micro-batch {args.micro_batch} per "
              f"worker, median of {args.batches} effective batches (worker 0)")
        print(f"{'configuration':<36} {'rounds':>7} {'MiB all-reduced':>16} {'wall s':>8} {'CPU s':>8}"
              "   per effective batch")
        labels = {
            "accum": f"AccumOptimizer(Adam, {args.k})",
            "reduce_each": "  same, all-reduce every micro-step",
            "plain": "Adam every micro-batch (no accum)",
        }
        for config in CONFIGS:
            r = w0[config]
            print(f"{labels[config]:<36} {r['rounds']:7.0f} {r['bytes'] / MiB:16.2f} "
                  f"{r['wall']:8.3f} {r['cpu']:8.3f}")
        base = w0["reduce_each"]
        print(f"accumulation on vs per-micro-step all-reduce: {base['bytes'] / w0['accum']['bytes']:.1f}x "
              f"fewer bytes, wall {w0['accum']['wall'] / base['wall']:.2f}x, "
              f"CPU {w0['accum']['cpu'] / base['cpu']:.2f}x")


if __name__ == "__main__":
    main()
