"""One of 2 JAX processes on localhost (CPU devices) training under `keras.distribution`
(tests/accum_jax/test_distribution_jax.py starts both).

    python -m tests.helpers.jax_multiprocess_worker OUT_DIR PROCESS_ID PORT

Each process has `LOCAL_DEVICES` virtual CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`), joins the other through
`keras.distribution.initialize("127.0.0.1:PORT", 2, PROCESS_ID)` (JAX's
`jax.distributed.initialize`; cross-process collectives on CPU through Gloo),
and trains the MLP of `tests.helpers.jax_distribution_worker` with
`AccumOptimizer(Adam, K)` under `DataParallel` over the 4 global devices, for
`MICRO_STEPS` global batches of B, feeding its own half of each batch
(`auto_shard_dataset=False`: each process reads its shard, as on several hosts),
two ways: Keras's train step (`keras`) and `accum.local_gradients` (`local`).
It writes `OUT_DIR/process<PROCESS_ID>.npz`: for each way, `<way>_<i>`, the
weights then every optimizer variable, gathered from both processes
(`multihost_utils.process_allgather`), a buffer with one row per device
summed over its rows; `names`; and, from the `local` way, the model saved by each
process, `OUT_DIR/process<PROCESS_ID>.keras`. The test compares both processes'
arrays, and the saved models loaded on one device, with one device's at the same
global batch.
"""

import os
import sys

LOCAL_DEVICES = 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

PROCESSES = 2
WAYS = ("keras", "local")


def train(way, process_id, out_dir):
    import accum
    from tests.helpers import jax_distribution_worker as w

    x, y = w.mlp_data()
    half = w.B // PROCESSES
    mine = np.concatenate([np.arange(i * w.B + process_id * half, i * w.B + (process_id + 1) * half)
                           for i in range(w.MICRO_STEPS)])
    distribution = keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    with distribution.scope():
        model = w.mlp()
        model.compile(w.accum_optimizer("buffer"), "mse")
        if way == "local":
            accum.local_gradients(model)
        model.fit(x[mine], y[mine], batch_size=half, shuffle=False, verbose=0)
    if way == "local":  # every process saves (its buffers' rows are on both processes)
        model.save(os.path.join(out_dir, f"process{process_id}.keras"))
    optimizer = model.optimizer
    rows = {id(b): len(v.shape) for b, v in zip(optimizer.accumulators, model.trainable_variables)}
    arrays = []
    for variable in list(model.weights) + list(optimizer.variables):
        value = np.asarray(multihost_utils.process_allgather(variable.value, tiled=True))
        if len(value.shape) == rows.get(id(variable), -1) + 1:
            value = value.sum(0)
        arrays.append(value)
    return arrays, [v.path for v in list(model.weights) + list(optimizer.variables)]


def main(out_dir, process_id, port):
    import recompute

    process_id = int(process_id)
    keras.distribution.initialize(f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=process_id)
    assert jax.process_count() == PROCESSES and len(jax.devices()) == PROCESSES * LOCAL_DEVICES
    recompute.exact_float32()
    results, names = {}, None
    for way in WAYS:
        arrays, names = train(way, process_id, out_dir)
        results.update({f"{way}_{i}": a for i, a in enumerate(arrays)})
    np.savez(os.path.join(out_dir, f"process{process_id}.npz"), names=np.array(names), **results)
    print(f"process {process_id} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
