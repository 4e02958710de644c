"""Keras 3 reference runs for the accum tests: the same inner optimizer at batch k*b."""

import keras
import numpy as np
import tensorflow as tf

VOCAB, TOKENS, FEATURES = 40, 3, 6


def make_data(n, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(dtype)
    ids = rng.integers(0, VOCAB, size=(n, TOKENS)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return x, ids, y


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


def fresh(optimizer):
    """A new, unbuilt optimizer with the same config."""
    return optimizer.__class__.from_config(optimizer.get_config())


def make_step(model, optimizer, compile=None, dense=False):
    """A train step on one batch; `compile` is None (eager), "function" or "jit".

    `dense=True` converts `IndexedSlices` gradients to dense tensors first (the
    dense reference: Keras 3 Adam squares sparse slices before summing
    duplicate indices, so its sparse path is not the batch-gradient math).
    """

    def step(x, ids, y):
        with tf.GradientTape() as tape:
            pred = model([x, ids], training=True)
            loss = tf.reduce_mean(tf.square(pred - y))
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    if compile == "function":
        return tf.function(step)
    if compile == "jit":
        return tf.function(step, jit_compile=True)
    return step


def batches(data, size):
    x, ids, y = data
    for start in range(0, len(x) - size + 1, size):
        yield x[start : start + size], ids[start : start + size], y[start : start + size]


def run(model, optimizer, data, batch_size, compile=None, dense=False):
    step = make_step(model, optimizer, compile, dense)
    for x, ids, y in batches(data, batch_size):
        step(tf.constant(x), tf.constant(ids), tf.constant(y))


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


def run_batches(model, optimizer, batch_list, dense=True):
    """One reference step per batch of `batch_list` (batches may differ in size)."""
    step = make_step(model, optimizer, None, dense)
    for x, ids, y in batch_list:
        step(tf.constant(x), tf.constant(ids), tf.constant(y))


def concat(data, start, stop):
    return tuple(a[start:stop] for a in data)


def state(model, optimizer):
    """All weights of `model` and all variables of `optimizer`, as NumPy arrays."""
    return [np.array(w) for w in model.get_weights()] + [np.array(v.numpy()) for v in optimizer.variables]
