"""tf_keras reference runs for the accum tests: the same inner optimizer at batch k*b."""

import numpy as np
import tensorflow as tf
import tf_keras as K

VOCAB, TOKENS, FEATURES = 40, 3, 6


def make_data(n, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(dtype)
    ids = rng.integers(0, VOCAB, size=(n, TOKENS)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return x, ids, y


def make_model(dtype="float32", seed=0, batch_norm=False, embedding=True):
    """A small model with an embedding (IndexedSlices gradients) and dense layers."""
    K.utils.set_random_seed(seed)
    x = K.Input((FEATURES,), dtype=dtype)
    ids = K.Input((TOKENS,), dtype="int32")
    if embedding:
        e = K.layers.Flatten(dtype=dtype)(K.layers.Embedding(VOCAB, 4, dtype=dtype)(ids))
    else:
        e = K.layers.Lambda(lambda t: tf.cast(t, dtype) / VOCAB, dtype=dtype)(ids)
    h = K.layers.Concatenate(dtype=dtype)([x, e])
    h = K.layers.Dense(8, activation="tanh", dtype=dtype)(h)
    if batch_norm:
        h = K.layers.BatchNormalization(dtype=dtype)(h)
    return K.Model([x, ids], K.layers.Dense(1, dtype=dtype)(h))


def twin(model):
    other = K.models.clone_model(model)
    other.set_weights(model.get_weights())
    return other


def fresh(optimizer):
    return optimizer.__class__.from_config(optimizer.get_config())


def make_step(model, optimizer, compile=None, dense=False):
    def step(x, ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([x, ids], training=True) - y))
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


def concat(data, start, stop):
    return tuple(a[start:stop] for a in data)


def run(model, optimizer, data, batch_size, compile=None, dense=False):
    step = make_step(model, optimizer, compile, dense)
    for start in range(0, len(data[0]) - batch_size + 1, batch_size):
        step(*concat(data, start, start + batch_size))


def run_batches(model, optimizer, batch_list, dense=True):
    step = make_step(model, optimizer, None, dense)
    for batch in batch_list:
        step(*batch)


def optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def state(model, optimizer):
    return [np.array(w) for w in model.get_weights()] + [
        np.array(v.numpy()) for v in optimizer_variables(optimizer)
    ]


def state_by_variable(model, optimizer):
    """Like `state`, but optimizer state listed per model variable and slot name, so the
    order does not depend on creation order (legacy optimizers restored from a
    checkpoint create their slots in restore order)."""
    out = [np.array(w) for w in model.get_weights()]
    opts = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        opts.append(inner)
        out += [np.array(int(optimizer.micro_steps)), np.array(int(optimizer.window_steps)),
                np.array(int(optimizer.window_count))]
    for opt in opts:
        out.append(np.array(int(opt.iterations)))
        for var in model.trainable_variables:
            for slot in opt.get_slot_names():
                out.append(opt.get_slot(var, slot).numpy())
    return out
