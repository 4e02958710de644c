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


# Each tuple: the optimizers that train the model, one `compile` and `fit` each (see
# `check_optimizer_switches`).
SWITCHES = [("accum", "plain", "accum"), ("accum+2", "accum+2", "plain", "accum+2")]


def check_optimizer_switches(keras, phases, make_inner):
    """`accum.BatchNormalization` trained in `phases`, each a `compile` and a `fit` on data
    shifted from the previous phase's; Keras's layer starts each phase from the model's
    weights (under an `AccumOptimizer` the weights differ from batch `K * B`'s: each
    micro-batch is normalized with its own statistics).

    - "accum": `AccumOptimizer(make_inner(), K)` at batch `B` (the same optimizer each
      time it comes back), against Keras's layer with `make_inner()` at batch `K * B`:
      equal moving statistics, the window empty.
    - "accum+2": the same with a new `AccumOptimizer`, and two more micro-batches left
      pending in the layer's window, which the next phase must drop.
    - "plain": `make_inner()` at batch `B` for both: equal moving statistics and weights.
    """
    import accum

    family = "tf_keras" if keras.__name__ == "tf_keras" else "keras3"
    model = make_model(keras, accum.BatchNormalization(momentum=0.8, dtype="float32", family=family))
    ref = make_model(keras, keras.layers.BatchNormalization(momentum=0.8, dtype="float32"))
    same = None
    for i, phase in enumerate(phases):
        for mine, theirs in zip(model.layers, ref.layers):
            theirs.set_weights(mine.get_weights()[:len(theirs.weights)])  # not the window's
        pending = 2 if phase == "accum+2" else 0
        x, y = make_data(K * B * WINDOWS + pending * B, seed=i)
        x += 3.0 * i  # the statistics move in every phase
        if phase == "plain":
            model.compile(make_inner(), "mse")
        elif phase == "accum":
            same = same or accum.AccumOptimizer(make_inner(), K)
            model.compile(same, "mse")
        else:
            model.compile(accum.AccumOptimizer(make_inner(), K), "mse")
        ref.compile(make_inner(), "mse")
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        whole = len(x) - pending * B
        ref.fit(x[:whole], y[:whole], batch_size=B if phase == "plain" else K * B, shuffle=False, verbose=0)
        assert_statistics_equal(bn_of(ref), bn_of(model))
        if phase == "plain":
            for want, got in zip(ref.trainable_weights, model.trainable_weights):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL,
                                           err_msg=(i, phase, want.name))
        np.testing.assert_array_equal(np.asarray(bn_of(model).accum_count), pending * B, err_msg=(i, phase))


def check_new_accum_optimizer_drops_window(keras):
    """An `AccumOptimizer` built on the layer's variables (a custom loop builds it first)
    while another left a partial window in the layer: the window is dropped, the layer
    linked to the new one (whose window ends move the statistics)."""
    import tensorflow as tf

    import accum

    family = "tf_keras" if keras.__name__ == "tf_keras" else "keras3"
    model = make_model(keras, accum.BatchNormalization(dtype="float32", family=family))
    layer, (x, y) = bn_of(model), make_data(B)
    first = accum.AccumOptimizer(keras.optimizers.SGD(0.01), K)
    first.build(model.trainable_variables)
    model(x, training=True)
    np.testing.assert_array_equal(np.asarray(layer.accum_count), B)
    second = accum.AccumOptimizer(keras.optimizers.SGD(0.01), K)
    second.build(model.trainable_variables)
    np.testing.assert_array_equal(np.asarray(layer.accum_count), 0)
    assert float(np.asarray(layer.accum_linked)) == 1.0
    before = np.asarray(layer.moving_mean).copy()
    for _ in range(K):  # one window of the new optimizer, in an eager loop
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        second.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    assert not np.allclose(np.asarray(layer.moving_mean), before)
    np.testing.assert_array_equal(np.asarray(layer.accum_count), 0)
