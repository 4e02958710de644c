"""Keras 3 reference runs for the accum tests: the same inner optimizer at batch k*b
(the family-free part, tests.helpers.accum_runs, imported here too)."""

import keras
import numpy as np

from tests.helpers.accum_runs import (  # noqa: F401 (the reference runs of this family)
    FEATURES, TOKENS, VOCAB, batches, concat, fresh, make_data, make_step, run, run_batches, state,
)


def make_model(dtype="float32", seed=0, batch_norm=False):
    """A small model with an embedding (IndexedSlices gradients) and dense layers."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,), dtype=dtype)
    ids = keras.Input((TOKENS,), dtype="int32")
    e = keras.layers.Embedding(VOCAB, 4, dtype=dtype)(ids)
    e = keras.layers.Flatten(dtype=dtype)(e)
    h = keras.layers.Concatenate(dtype=dtype)([x, e])
    h = keras.layers.Dense(8, activation="tanh", dtype=dtype)(h)
    if batch_norm:
        h = keras.layers.BatchNormalization(dtype=dtype)(h)
    out = keras.layers.Dense(1, dtype=dtype)(h)
    return keras.Model([x, ids], out)


def twin(model):
    """A copy of `model` with the same weights."""
    other = keras.models.clone_model(model)
    other.set_weights(model.get_weights())
    return other


def slot_values(optimizer):
    """{name: value} of an optimizer's variables (names made unique by position)."""
    out = {}
    for i, v in enumerate(optimizer.variables):
        out[f"{i}:{v.name}"] = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
    return out


def make_dense_model(seed=0):
    """A dense-only model (for Adam references through `fit`: no sparse gradients)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    ids = keras.Input((TOKENS,), dtype="int32")
    h = keras.layers.Concatenate()([x, keras.ops.cast(ids, "float32") / VOCAB])
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model([x, ids], keras.layers.Dense(1)(h))
