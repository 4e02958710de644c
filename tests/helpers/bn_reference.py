"""`accum.BatchNormalization` checks shared by the Keras 3 and tf_keras suites.

The layer sits on the model's inputs, so its inputs are the data whatever the
training does, and its moving statistics after `fit` with `AccumOptimizer(k)`
at batch `b` must equal a plain `BatchNormalization`'s at batch `k * b`.
"""

import numpy as np

K, B, WINDOWS, FEATURES = 4, 6, 3, 5
TOL = 1e-6


def make_data(n, seed=0, shape=(FEATURES,)):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n,) + shape) * 3.0 + 2.0).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def make_model(keras, layer, kind="sequential", shape=(FEATURES,)):
    """`layer` on the inputs, then a small MLP head; Sequential, functional or subclassed."""
    keras.utils.set_random_seed(0)
    flat = int(np.prod(shape))
    if kind == "sequential":
        return keras.Sequential([keras.Input(shape), layer, keras.layers.Reshape((flat,)),
                                 keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    if kind == "functional":
        inputs = keras.Input(shape)
        h = keras.layers.Reshape((flat,))(layer(inputs))
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(h)))

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm, self.flat = layer, keras.layers.Reshape((flat,))
            self.hidden, self.head = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)

        def call(self, x, training=None):
            return self.head(self.hidden(self.flat(self.norm(x, training=training))))

    net = Net()
    net(np.zeros((1,) + shape, "float32"))
    return net


def statistics(layer):
    return [np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)]


def assert_statistics_equal(reference, actual, tol=TOL):
    for name, want, got in zip(("moving_mean", "moving_variance"), statistics(reference), statistics(actual)):
        err = np.max(np.abs(want - got)) / np.max(np.abs(want))
        assert err <= tol, (name, err, want, got)
    # the statistics did move (the comparison is not between two initial states)
    assert not np.allclose(statistics(reference)[0], 0.0)


def bn_of(model):
    """The model's (only) BatchNormalization layer."""
    return [layer for layer in model._flatten_layers() if "BatchNormalization" in type(layer).__name__][0]


def fit_both(model, optimizer, ref, ref_optimizer, x, y, **fit_kwargs):
    """`model` with the `AccumOptimizer` at batch `B`, `ref` with the plain optimizer at
    batch `K * B`, on the same data; asserts the moving statistics are equal."""
    model.compile(optimizer, "mse")
    ref.compile(ref_optimizer, "mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, **fit_kwargs)
    ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))


_RESUME = r"""
import json, sys, numpy as np
lib, path, start, stop = sys.argv[1:5]
keras = __import__(lib)  # before accum: a tf_keras program imports tf_keras first
import accum
from tests.helpers.bn_reference import B, bn_of, make_data
start, stop = int(start), int(stop)
model = keras.models.load_model(path)
x, y = make_data(stop * B)
for i in range(start, stop):
    model.train_on_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
print(json.dumps([np.asarray(bn_of(model).moving_mean).tolist(), np.asarray(bn_of(model).moving_variance).tolist()]))
"""


def check_resume_in_fresh_process(keras, model, path):
    """Trains `model` (compiled with an `AccumOptimizer(k=K)`) 3 windows, saving to `path`
    with two micro-steps pending; a fresh process loads it and finishes: the moving
    statistics must be bit-identical to the uninterrupted run's."""
    import json
    import os
    import subprocess
    import sys

    stop, total = K + 2, 3 * K
    x, y = make_data(total * B)
    for i in range(total):
        if i == stop:
            model.save(path)
            assert np.any(np.asarray(bn_of(model).accum_count))  # mid-window
        model.train_on_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _RESUME, keras.__name__, path, str(stop), str(total)],
                         cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    mean, variance = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_array_equal(np.asarray(bn_of(model).moving_mean), np.float32(mean))
    np.testing.assert_array_equal(np.asarray(bn_of(model).moving_variance), np.float32(variance))


def loop_both(model, optimizer, ref, ref_optimizer, x, y, compiled=True):
    """`model` trained by a custom loop (`tf.function` if `compiled`) with the
    `AccumOptimizer` at batch `B`, `ref` by `fit` at batch `K * B`; asserts the
    moving statistics are equal."""
    import tensorflow as tf

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(step) if compiled else step
    for i in range(0, len(x), B):
        step(tf.constant(x[i:i + B]), tf.constant(y[i:i + B]))
    ref.compile(ref_optimizer, "mse")
    ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))
