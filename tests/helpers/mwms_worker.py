"""One `MultiWorkerMirroredStrategy` worker for the multi-process tests (started by `mwms.py`).

    TF_CONFIG=... python -m tests.helpers.mwms_worker keras3|tf_keras OUT_DIR

Trains two tiny models with `AccumOptimizer` (k=4, global micro-batch 6, 2
updates): "adam" (Adam, LR schedule, clipnorm; dense model) and "sgd" (SGD
with momentum; embedding model), and writes the weights, the inner optimizers'
iterations and the all-reduce rounds executed to `OUT_DIR/worker<task>.npz`.
The tests compare them with one process.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

K, B = 4, 6


def custom_loop(strategy, model, optimizer, data, task, workers):
    """Each worker feeds its own slice of every global batch of `B`; loss averaged over `B`."""

    def replica_step(x, ids, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model([x, ids], training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=B)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    @tf.function
    def step(x, ids, y):
        strategy.run(replica_step, args=(x, ids, y))

    from benchmarks.allreduce import AllReduceCounter

    counter = AllReduceCounter()
    local = B // workers
    with counter.counting():
        for start in range(0, len(data[0]), B):
            rows = slice(start + task * local, start + (task + 1) * local)
            step(*(tf.constant(a[rows]) for a in data))
    return int(counter.rounds.numpy())


def keras3(strategy, task, workers):
    """Custom loops only: Keras 3's `fit` does not run under MultiWorkerMirroredStrategy
    (keras-team/keras#20585; eager reductions of the data and of the logs fail)."""
    import keras

    from accum import AccumOptimizer

    from tests.helpers.k3_reference import make_data, make_dense_model, make_model

    data = make_data(K * B * 2)
    out = {}
    for key, make_model_, make_inner in (
        ("adam", make_dense_model, lambda: keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5)),
        # an embedding: sparse gradients into dense buffers
        ("sgd", make_model, lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    ):
        with strategy.scope():
            model = make_model_()
            inner = make_inner()
            optimizer = AccumOptimizer(inner, K)
            optimizer.build(model.trainable_variables)
        out[f"{key}_rounds"] = custom_loop(strategy, model, optimizer, data, task, workers)
        out[key] = model.get_weights()
        out[f"{key}_iterations"] = int(inner.iterations.numpy())
    return out


def tf_keras(strategy, task, workers):
    """`fit` with a new-style optimizer, a custom loop with a legacy one."""
    import tf_keras as tfk

    from accum import AccumOptimizer
    from benchmarks.allreduce import AllReduceCounter

    from tests.helpers.tfk_reference import make_data, make_model

    x, ids, y = data = make_data(K * B * 2)
    with strategy.scope():
        model = make_model(embedding=False)
        inner = tfk.optimizers.Adam(
            tfk.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5
        )
        model.compile(AccumOptimizer(inner, K), "mse")
    # tf_keras's fit also all-reduces its loss metric (scalars) at every step,
    # and MultiWorkerMirroredStrategy's dataset a [1, 1] tensor: not counted.
    counter = AllReduceCounter(functions_only=True, min_elements=2)
    with counter.counting():
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    out = {"adam": model.get_weights(), "adam_iterations": int(inner.iterations.numpy()),
           "adam_rounds": int(counter.rounds.numpy())}
    with strategy.scope():
        model = make_model()
        inner = tfk.optimizers.legacy.SGD(0.05, momentum=0.9)
        optimizer = AccumOptimizer(inner, K)
        optimizer.build(model.trainable_variables)
    out["sgd_rounds"] = custom_loop(strategy, model, optimizer, data, task, workers)
    out["sgd"] = model.get_weights()
    out["sgd_iterations"] = int(inner.iterations.numpy())
    return out


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    config = json.loads(os.environ["TF_CONFIG"])
    task, workers = config["task"]["index"], len(config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    out = {"keras3": keras3, "tf_keras": tf_keras}[scenario](strategy, task, workers)
    weights = {f"{key}_{i}": w for key in ("adam", "sgd") for i, w in enumerate(out.pop(key))}
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), **weights, **out)
    sys.stdout.flush()
    # TensorFlow's collective runtime can crash while the interpreter shuts down;
    # the results are written, so leave without running the teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
