"""Benchmark: all-reduce traffic and step time of `AccumOptimizer` on 2 workers (loopback).

    python -m accum.distribute_benchmark            # MLP of 1.6M parameters (6 MiB), k=8
    python -m accum.distribute_benchmark --quick    # 0.15M parameters, k=4
    python -m accum.distribute_benchmark --json out.json

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
executed (counted at run time by `AllReduceCounter`: bytes are one worker's
payload), the wall time and the process CPU time (all threads), medians over
`--batches` effective batches after one of warm-up. The configurations are
interleaved batch by batch, so load from other jobs hits them alike. The
table shows worker 0; both workers' figures go to `--json`.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import values as _values


def _payload_bytes(value):
    """Bytes one replica contributes to the reduction of `value` (a tensor: run time)."""
    if isinstance(value, _values.DistributedValues):
        value = value.values[0]
    if isinstance(value, tf.IndexedSlices):
        return _payload_bytes(value.values) + _payload_bytes(value.indices)
    if isinstance(value, tf.Variable):
        dtype = value.dtype
        size = tf.size(value.read_value(), out_type=tf.int64)
    else:
        value = tf.convert_to_tensor(value)
        dtype = value.dtype
        size = tf.size(value, out_type=tf.int64)
    return size * np.dtype(dtype.as_numpy_dtype).itemsize


def _static_size(value):
    """Elements of one replica's `value` if known while tracing, else a large number."""
    if isinstance(value, _values.DistributedValues):
        value = value.values[0]
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    size = value.shape.num_elements()
    return float("inf") if size is None else size


class AllReduceCounter:
    """Counts the cross-replica reductions a strategy *executes*, and the bytes per replica.

    While `counting()` is active, every call of a `CrossDeviceOps.reduce` or
    `CrossDeviceOps.batch_reduce` (the entry points of every strategy's
    all-reduce: `ReductionToOneDevice` and `AllReduceCrossDeviceOps` for
    `MirroredStrategy`, `CollectiveAllReduce` for `MultiWorkerMirroredStrategy`)
    adds, next to the reduction it builds, ops that increment `rounds` by one
    and `bytes` by the payload of one replica. Inside a `tf.function` these ops
    live in the same graph (and `tf.cond` branch) as the reduction, so the
    counters count executions at run time, not traces. A `batch_reduce` of
    many tensors is one round. Reductions `CrossDeviceOps` short-cuts as local
    (one process, one value) are not counted.

    `functions_only=True` ignores reductions run eagerly (Keras 3's `fit`
    reduces a few scalars and its first batch eagerly, once per call, outside
    the train step). `min_elements=n` ignores rounds whose tensors all have
    fewer than `n` elements: bookkeeping that runs at every step whatever the
    optimizer (tf_keras's `fit` reduces its loss metric's total and count;
    under `MultiWorkerMirroredStrategy` the distributed dataset all-reduces a
    `[1, 1]` tensor per batch to agree on the end of the data).

    Create it outside any strategy scope (its variables are plain). Wrap the
    *tracing* of the functions to count (the first call of a `tf.function`,
    `fit`'s first step); the counters then count every later execution too.
    """

    def __init__(self, functions_only=False, min_elements=0):
        self.functions_only = functions_only
        self.min_elements = min_elements
        with tf.init_scope():
            self.rounds = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_rounds")
            self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_bytes")

    def reset(self):
        self.rounds.assign(0)
        self.bytes.assign(0)

    def _record(self, ops, values):
        if self.functions_only and tf.executing_eagerly():
            return
        # What `CrossDeviceOps` itself short-cuts as local: one process and one value.
        workers = ops._num_between_graph_workers
        values = [v for v in values
                  if workers > 1 or (isinstance(v, _values.DistributedValues) and len(v.values) > 1)]
        if not values:
            return
        if all(_static_size(v) < self.min_elements for v in values):
            return
        self.rounds.assign_add(1)
        self.bytes.assign_add(tf.add_n([_payload_bytes(v) for v in values]))

    @contextlib.contextmanager
    def counting(self):
        base = _cross_device_ops.CrossDeviceOps
        original_reduce, original_batch_reduce = base.reduce, base.batch_reduce
        counter = self

        def reduce(self, reduce_op, per_replica_value, destinations, options=None):
            out = original_reduce(self, reduce_op, per_replica_value, destinations, options)
            counter._record(self, [per_replica_value])
            return out

        def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
            out = original_batch_reduce(self, reduce_op, value_destination_pairs, options)
            counter._record(self, [v for v, _ in value_destination_pairs])
            return out

        base.reduce, base.batch_reduce = reduce, batch_reduce
        try:
            yield self
        finally:
            base.reduce, base.batch_reduce = original_reduce, original_batch_reduce


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
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
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
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's collective runtime may crash at interpreter shutdown


def _free_ports(n):
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_workers(argv, workers=2, timeout=600.0):
    """Starts `workers` processes of this module (`--worker`), returns their results."""
    ports = _free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(workers):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "accum.distribute_benchmark", "--worker", *argv],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"workers did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for i, (p, text) in enumerate(zip(procs, outputs)):
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"worker {i} failed (exit {p.returncode}):\n{text[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return sorted(results, key=lambda r: r["task"])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="All-reduce bytes and step time of AccumOptimizer on 2 workers on loopback.")
    parser.add_argument("--quick", action="store_true", help="small MLP, k=4, 3 effective batches")
    parser.add_argument("--k", type=int, default=None, help="steps_per_update (default 8; --quick 4)")
    parser.add_argument("--micro-batch", type=int, default=16, help="per-worker micro-batch")
    parser.add_argument("--batches", type=int, default=None, help="effective batches timed (default 5)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--features", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.k = args.k or (4 if quick else 8)
    args.batches = args.batches or (3 if quick else 5)
    args.features = args.features or (64 if quick else 512)
    args.hidden = args.hidden or (256 if quick else 1024)
    args.layers = args.layers or (3 if quick else 2)
    if args.worker:
        return _worker(args)
    forwarded = ["--k", str(args.k), "--micro-batch", str(args.micro_batch), "--batches",
                 str(args.batches), "--features", str(args.features), "--hidden", str(args.hidden),
                 "--layers", str(args.layers)]
    results = run_workers(forwarded, timeout=args.timeout)
    w0 = results[0]
    params = w0["accum"]["parameters"]
    print(f"2 workers (MultiWorkerMirroredStrategy, loopback), MLP {params / 1e6:.2f}M parameters "
          f"({params * 4 / 2**20:.1f} MiB float32), k={args.k}, micro-batch {args.micro_batch} per "
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
        print(f"{labels[config]:<36} {r['rounds']:7.0f} {r['bytes'] / 2**20:16.2f} "
              f"{r['wall']:8.3f} {r['cpu']:8.3f}")
    base = w0["reduce_each"]
    print(f"accumulation on vs per-micro-step all-reduce: {base['bytes'] / w0['accum']['bytes']:.1f}x "
          f"fewer bytes, wall {w0['accum']['wall'] / base['wall']:.2f}x, "
          f"CPU {w0['accum']['cpu'] / base['cpu']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "workers": results},
                      f, indent=2)
    return results


if __name__ == "__main__":
    main()
