"""How close `accum.BatchNormalization`'s moving statistics come to a plain layer at batch k*b.

    python -m benchmarks.accum_batchnorm                 # about 1 minute on 2 CPU cores
    python -m benchmarks.accum_batchnorm --docs docs/accumulation.md

For each case, a model whose first layer is `accum.BatchNormalization` (so its
inputs are the data, whatever the training does) is trained with
`AccumOptimizer(k)` at batch `b` by `fit`, and the same model with Keras's
`BatchNormalization` and the inner optimizer at batch `k * b`. Printed: the
largest relative difference of the moving mean and of the moving variance
(max |a - b| / max |b|), and, for scale, the same distance for Keras's layer
under the `AccumOptimizer` (statistics per micro-batch). Cases: Keras 3 in
each mode, under mixed_float16, under `MirroredStrategy` (2 logical CPUs);
tf_keras with dense and with convolutional (fused kernel) inputs.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import harness  # noqa: E402

TOOL = "benchmarks.accum_batchnorm"


def data(n, shape, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n,) + shape) * 3.0 + 2.0).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def model(lib, layer, shape):
    import numpy as np

    lib.utils.set_random_seed(0)
    return lib.Sequential([lib.Input(shape), layer, lib.layers.Reshape((int(np.prod(shape)),)),
                           lib.layers.Dense(4, activation="tanh"), lib.layers.Dense(1)])


def distance(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_case(lib, k, b, windows, mode="buffer", shape=(5,), strategy=None, policy=None):
    """Returns (moving mean distance, moving variance distance, Keras's layer's distances)."""
    import accum

    def inner():
        if mode == "momentum":
            return lib.optimizers.SGD(0.05, momentum=0.9)
        return lib.optimizers.Adam(1e-2)

    def wrap(optimizer):
        if policy is None:
            return optimizer
        if lib.__name__ == "keras":
            return lib.optimizers.LossScaleOptimizer(optimizer, initial_scale=1.0)
        return lib.mixed_precision.LossScaleOptimizer(optimizer, dynamic=False, initial_scale=1.0)

    x, y = data(k * b * windows, shape)
    set_policy = (lib.mixed_precision.set_dtype_policy if lib.__name__ == "keras"
                  else lib.mixed_precision.set_global_policy)
    if policy:
        set_policy(policy)
    try:
        runs = {}
        for name, layer in (("accum", accum.BatchNormalization(family=_family(lib))),
                            ("keras", lib.layers.BatchNormalization())):
            if strategy is not None:
                with strategy.scope():
                    m = model(lib, layer, shape)
                    optimizer = wrap(accum.AccumOptimizer(inner(), k, mode=mode))
            else:
                m = model(lib, layer, shape)
                optimizer = wrap(accum.AccumOptimizer(inner(), k, mode=mode))
            m.compile(optimizer, "mse")
            m.fit(x, y, batch_size=b, shuffle=False, verbose=0)
            runs[name] = m.layers[0]
        ref = model(lib, lib.layers.BatchNormalization(), shape)
        ref.compile(wrap(inner()), "mse")
        ref.fit(x, y, batch_size=k * b, shuffle=False, verbose=0)
    finally:
        if policy:
            set_policy("float32")
    want = ref.layers[0]
    return [distance(getattr(runs[name], stat), getattr(want, stat))
            for name in ("accum", "keras") for stat in ("moving_mean", "moving_variance")]


def _family(lib):
    return "keras3" if lib.__name__ == "keras" else "tf_keras"


def main(argv=None):
    """Runs every case; prints the table (and writes `--docs`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {TOOL}", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=harness.positive_int, default=4, help="steps_per_update (default 4)")
    parser.add_argument("--batch-size", type=harness.positive_int, default=6, help="micro-batch size b (default 6)")
    parser.add_argument("--windows", type=harness.positive_int, default=3, help="windows trained (default 3)")
    harness.add_docs_argument(parser, TOOL)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)
    progress = harness.Progress(TOOL)

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import tf_keras

    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    cases = [
        ("Keras 3, mode=buffer", keras, {}),
        ("Keras 3, mode=momentum", keras, {"mode": "momentum"}),
        ("Keras 3, mode=rescale", keras, {"mode": "rescale"}),
        ("Keras 3, mixed_float16", keras, {"policy": "mixed_float16"}),
        ("Keras 3, MirroredStrategy (2 replicas)", keras, {"strategy": strategy}),
        ("tf_keras, dense inputs", tf_keras, {}),
        ("tf_keras, 4x4x3 images (fused kernel)", tf_keras, {"shape": (4, 4, 3)}),
        ("tf_keras, MirroredStrategy (2 replicas)", tf_keras, {"strategy": strategy}),
    ]
    start, rows = time.perf_counter(), []
    for name, lib, kwargs in cases:
        progress(name)
        rows.append((name, run_case(lib, args.k, args.batch_size, args.windows, **kwargs)))
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(f"k={args.k}, b={args.batch_size}, {args.windows} windows; distance = max |a - ref| / max |ref| "
              f"of the moving statistics, ref: Keras's BatchNormalization at batch {args.k * args.batch_size}")
        print()
        print("| case | accum.BatchNormalization: mean | variance | Keras's layer under AccumOptimizer: mean | variance |")
        print("|---|---|---|---|---|")
        for name, d in rows:
            print(f"| {name} | " + " | ".join(f"{v:.1e}" for v in d) + " |")
    progress(f"{time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
