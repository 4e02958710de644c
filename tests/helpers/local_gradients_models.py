"""The small model, data and distribution the `accum.local_gradients` tests share (in the
pytest processes and in `local_gradients_worker`'s process of 4 devices)."""

import jax
import keras
import numpy as np


def mlp(extra=None):
    """A 3 -> 5 (tanh) -> 2 MLP, seed 0; `extra(h)`, if given, is applied to the hidden layer."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(5, activation="tanh")(inputs)
    if extra is not None:
        h = extra(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def data(n):
    """`n` random (x, y) rows for `mlp`, seed 0."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def data_parallel():
    """`keras.distribution.DataParallel` over every JAX device of the process."""
    return keras.distribution.DataParallel(devices=jax.devices())
