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
