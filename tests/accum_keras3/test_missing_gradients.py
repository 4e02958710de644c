"""Keras 3: a variable missing from some micro-steps (absent from the list, or a `None`
gradient) counts a zero gradient there; one untouched by a whole window is left alone.

Reference: the same inner optimizer fed the big batch, whose gradient is the mean of
the window's micro-step gradients (zero where a micro-step has none), and which does
not see a variable with no gradient in the whole window.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer


def _optimizer(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(1.0)
    if kind == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    if kind == "adam":
        return keras.optimizers.Adam(0.1)
    return keras.optimizers.AdamW(0.1, weight_decay=0.1)


# ------------------------------------------------------------- minimal a/b


@pytest.mark.parametrize("missing", ["absent", "none"])
@pytest.mark.parametrize("compile", [False, True])
def test_minimal_sgd(missing, compile):
    a = keras.Variable(np.zeros(2, "float32"), name="a")
    b = keras.Variable(np.zeros(2, "float32"), name="b")
    opt = AccumOptimizer(keras.optimizers.SGD(1.0), 2)
    opt.build([a, b])

    def both():
        opt.apply_gradients([(tf.constant([2.0, 2.0]), a), (tf.constant([4.0, 4.0]), b)])

    def only_a():
        if missing == "absent":
            opt.apply_gradients([(tf.constant([6.0, 6.0]), a)])
        else:
            opt.apply_gradients([(tf.constant([6.0, 6.0]), a), (None, b)])

    if compile:
        both, only_a = tf.function(both), tf.function(only_a)
    both()
    only_a()
    np.testing.assert_array_equal(a.numpy(), [-4.0, -4.0])
    np.testing.assert_array_equal(b.numpy(), [-2.0, -2.0])  # mean of 4 and 0
    assert int(opt.iterations) == 1
    for flag in opt.touched:
        assert int(flag.numpy()) == 0
    for acc in opt.accumulators:
        np.testing.assert_array_equal(acc.numpy(), 0.0)


# ------------------------------------------------------ multi-task, two heads


def _multitask_model(seed=0):
    keras.utils.set_random_seed(seed)
    trunk = keras.layers.Dense(5, activation="tanh", name="trunk")
    head_a = keras.layers.Dense(1, name="head_a", kernel_constraint=keras.constraints.MaxNorm(0.5))
    head_b = keras.layers.Dense(1, name="head_b")
    x = keras.Input((4,))
    h = trunk(x)
    return keras.Model(x, [head_a(h), head_b(h)]), trunk, head_a, head_b


def _losses(model, x, y, task):
    out_a, out_b = model(x)
    return tf.reduce_mean(tf.square((out_a if task == "a" else out_b) - y))


def _task_variables(trunk, head_a, head_b, task):
    head = head_a if task == "a" else head_b
    return trunk.trainable_variables + head.trainable_variables


def _data(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _run_accum(opt, tasks, k, b, compile, flush_at=None):
    model, trunk, head_a, head_b = _multitask_model()
    opt.build(model.trainable_variables)
    x, y = _data(len(tasks) * b)

    def make(task):
        variables = _task_variables(trunk, head_a, head_b, task)

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _losses(model, xb, yb, task)
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        return tf.function(step) if compile else step

    steps = {"a": make("a"), "b": make("b")}
    for i, task in enumerate(tasks):
        steps[task](x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
        if flush_at is not None and i + 1 == flush_at:
            opt.flush()
    return model


def _run_reference(opt, tasks, k, b, flush_at=None):
    """One inner step per window on the mean of its micro-batch losses; variables with
    no gradient in the window are not passed (as at batch k*b)."""
    model, trunk, head_a, head_b = _multitask_model()
    opt.build(model.trainable_variables)
    x, y = _data(len(tasks) * b)
    variables = model.trainable_variables
    windows, start = [], 0
    while start < len(tasks):
        stop = start + k
        if flush_at is not None and start < flush_at < stop:
            stop = flush_at
        windows.append((start, min(stop, len(tasks))))
        start = stop
    for start, stop in windows:
        if stop - start < k and (flush_at is None or stop != flush_at):
            break  # pending partial window: not applied
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [_losses(model, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], tasks[i]) for i in range(start, stop)]
            ) / (stop - start)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
    return model


def _assert_same(ref_model, ref_opt, model, inner, tol):
    for r, g in zip(ref_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)
    assert len(ref_opt.variables) == len(inner.variables)
    for r, g in zip(ref_opt.variables, inner.variables):
        np.testing.assert_allclose(np.array(g.numpy()), np.array(r.numpy()), rtol=tol, atol=tol, err_msg=r.path)


# alternating heads: every window touches both; "aabb": windows that touch one head only
SCHEDULES = {"abab": list("abababab"), "aabb": list("aabbaabb"), "aaab": list("aaabaaab")}


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("compile", [False, True])
def test_multitask_buffer(kind, schedule, compile):
    tasks = SCHEDULES[schedule]
    k, b = 2, 3
    opt = AccumOptimizer(_optimizer(kind), k)
    model = _run_accum(opt, tasks, k, b, compile)
    ref_opt = _optimizer(kind)
    ref = _run_reference(ref_opt, tasks, k, b)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer, 1e-6)


def test_head_never_moves_regression():
    """The reported symptom: alternating two heads with k=2, head A used to stay put."""
    tasks = list("abababab")
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), 2)
    model = _run_accum(opt, tasks, 2, 3, compile=True)
    initial, *_ = _multitask_model()
    head_a = [w for w in model.weights if "head_a" in w.path]
    head_a0 = [w for w in initial.weights if "head_a" in w.path]
    assert any(not np.allclose(w.numpy(), w0.numpy()) for w, w0 in zip(head_a, head_a0))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("flush_at", [1, 3, 6])
def test_multitask_flush(kind, flush_at):
    tasks = list("aabbaab")
    k, b = 3, 2
    opt = AccumOptimizer(_optimizer(kind), k)
    model = _run_accum(opt, tasks, k, b, compile=True, flush_at=flush_at)
    ref_opt = _optimizer(kind)
    ref = _run_reference(ref_opt, tasks, k, b, flush_at=flush_at)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer, 1e-6)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_multitask_momentum_mode(schedule):
    """`mode="momentum"` with SGD momentum: exact, also for missing variables."""
    tasks = SCHEDULES[schedule]
    k, b = 2, 3
    opt = AccumOptimizer(_optimizer("momentum"), k, mode="momentum")
    model = _run_accum(opt, tasks, k, b, compile=True)
    ref_opt = _optimizer("momentum")
    ref = _run_reference(ref_opt, tasks, k, b)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer, 1e-6)


def test_untouched_adam_moments_do_not_decay():
    """A variable with no gradient in a whole window keeps its weights and Adam moments."""
    a = keras.Variable(np.ones(2, "float32"), name="a")
    b = keras.Variable(np.ones(2, "float32"), name="b")
    opt = AccumOptimizer(keras.optimizers.Adam(0.1), 2)
    opt.build([a, b])
    g = tf.constant([1.0, 2.0])
    for _ in range(2):
        opt.apply_gradients([(g, a), (g, b)])
    b_after, slots_after = b.numpy(), [v.numpy() for v in opt.inner_optimizer.variables if "b_" in v.path]
    for _ in range(2):
        opt.apply_gradients([(g, a)])
    np.testing.assert_array_equal(b.numpy(), b_after)
    for v, before in zip([v for v in opt.inner_optimizer.variables if "b_" in v.path], slots_after):
        np.testing.assert_array_equal(v.numpy(), before)
    assert int(opt.iterations) == 2
