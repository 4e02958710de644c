"""The family-free part of the accum reference runs (tests.helpers.k3_reference and
tfk_reference add each family's models): data, train steps, runs at a batch size, state."""

import numpy as np
import tensorflow as tf

VOCAB, TOKENS, FEATURES = 40, 3, 6


def make_data(n, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(dtype)
    ids = rng.integers(0, VOCAB, size=(n, TOKENS)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return x, ids, y


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


def concat(data, start, stop):
    return tuple(a[start:stop] for a in data)


def run(model, optimizer, data, batch_size, compile=None, dense=False):
    step = make_step(model, optimizer, compile, dense)
    for x, ids, y in batches(data, batch_size):
        step(tf.constant(x), tf.constant(ids), tf.constant(y))


def run_batches(model, optimizer, batch_list, dense=True):
    """One reference step per batch of `batch_list` (batches may differ in size)."""
    step = make_step(model, optimizer, None, dense)
    for x, ids, y in batch_list:
        step(tf.constant(x), tf.constant(ids), tf.constant(y))


def optimizer_variables(optimizer):
    """An optimizer's variables (a method on tf_keras's legacy optimizers)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def state(model, optimizer):
    """All weights of `model` and all variables of `optimizer`, as NumPy arrays."""
    return [np.array(w) for w in model.get_weights()] + [np.array(v.numpy()) for v in optimizer_variables(optimizer)]


def train_both(reference, make_inner, k, b, updates, dtype="float32", compile=None, **accum_options):
    """A model trained by `AccumOptimizer(inner, k, **accum_options)` at batch `b`, and
    its twin by a fresh `inner` at batch k*b (dense gradients), `updates` windows each;
    `reference` is the family's module (tests.helpers.k3_reference or tfk_reference).
    Returns (model, opt, ref_model, ref_opt)."""
    from accum import AccumOptimizer

    data = make_data(k * b * updates, dtype=dtype)
    model = reference.make_model(dtype)
    ref_model = reference.twin(model)
    inner = make_inner()
    ref_opt = fresh(inner)
    opt = AccumOptimizer(inner, k, **accum_options)
    run(model, opt, data, b, compile)
    run(ref_model, ref_opt, data, k * b, compile, dense=True)
    return model, opt, ref_model, ref_opt


def accumulated_and_big_batch(reference, make_inner, dtype, k, b, updates, compile=None):
    """`train_both`, with the counters checked: `updates` inner steps, k micro-steps each."""
    model, opt, ref_model, ref_opt = train_both(reference, make_inner, k, b, updates, dtype, compile)
    assert int(opt.iterations) == int(ref_opt.iterations) == updates
    assert int(opt.micro_steps) == k * updates
    return model, opt, ref_model, ref_opt


def micro_gradients(model, data, k, b):
    """The dense gradients of each of the first `k` micro-batches of `b` (NumPy), at the
    model's current weights."""
    variables = model.trainable_variables
    grads = []
    for i in range(k):
        x, ids, y = concat(data, i * b, (i + 1) * b)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([x, ids]) - y))
        grads.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)])
    return grads


def run_micro_batches(model, optimizer, data, k, b):
    """One eager step per micro-batch of `b`, the first `k`."""
    step = make_step(model, optimizer)
    for i in range(k):
        step(*concat(data, i * b, (i + 1) * b))


def check_k1_is_the_inner_optimizer(reference, inner, b):
    """k=1: bit-identical to the inner optimizer at the same batch."""
    from accum import AccumOptimizer

    data = make_data(b * 5)
    model = reference.make_model()
    ref_model = reference.twin(model)
    ref_opt = fresh(inner)
    run(model, AccumOptimizer(inner, 1), data, b)
    run(ref_model, ref_opt, data, b)
    for x, y in zip(ref_model.get_weights() + [v.numpy() for v in optimizer_variables(ref_opt)],
                    model.get_weights() + [v.numpy() for v in optimizer_variables(inner)]):
        np.testing.assert_array_equal(x, y)


def resume_keras_file_mid_window(K, model, data, b, path, iterations_at_load=None):
    """`model` (compiled with an AccumOptimizer, k=4) trained with `train_on_batch` on
    micro-batches 0-9 of `b`, saved to the `.keras` file `path`, trained on to 19;
    loaded (mid-window: 2 micro-steps pending; `iterations_at_load` inner steps if
    given) and trained on 10-19 again. Returns the states of the two (`state`)."""
    from accum import AccumOptimizer

    def train(m, start, stop):
        for i in range(start, stop):
            bx, bi, by = concat(data, i * b, (i + 1) * b)
            m.train_on_batch([bx, bi], by)

    train(model, 0, 10)
    model.save(path)
    train(model, 10, 20)
    expected = state(model, model.optimizer)
    loaded = K.models.load_model(path)
    assert isinstance(loaded.optimizer, AccumOptimizer) and int(loaded.optimizer.window_steps) == 2
    if iterations_at_load is not None:
        assert int(loaded.optimizer.iterations) == iterations_at_load
    train(loaded, 10, 20)
    return expected, state(loaded, loaded.optimizer)


def fit_with_lr_callback(reference, K, inner, k, b):
    """`fit` with `AccumOptimizer(inner, k)` at batch `b`, and of the dense model's twin with
    a fresh `inner` at batch k*b, 3 epochs, learning rate halved each epoch by a
    `LearningRateScheduler` (from 0.05). Returns (model, ref, ref_opt)."""
    from accum import AccumOptimizer

    x, ids, y = make_data(k * b * 4)
    model = reference.make_dense_model()
    ref = reference.twin(model)
    ref_opt = fresh(inner)
    schedule = K.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5**epoch)
    model.compile(AccumOptimizer(inner, k), "mse")
    ref.compile(ref_opt, "mse")
    model.fit([x, ids], y, batch_size=b, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    ref.fit([x, ids], y, batch_size=k * b, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    return model, ref, ref_opt
