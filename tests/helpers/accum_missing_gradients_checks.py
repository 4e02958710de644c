"""AccumOptimizer with variables missing from some micro-steps (absent from the list, or
a `None` gradient), for both Keras families: they count a zero gradient there; one
untouched by a whole window is left alone.

Reference: the same inner optimizer fed the big batch (the mean of the window's
micro-batch losses), which does not see a variable with no gradient in the window.
tests/accum_keras3/test_missing_gradients.py and
tests/accum_tf_keras/test_missing_gradients_tf_keras.py import the tests with their
family's fixtures `family` and `legacy` (tests.helpers.accum_family_checks; tf_keras:
new-style and legacy optimizers) and add their own.
"""

import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from tests.helpers.accum_runs import optimizer_variables

__all__ = ["test_multitask_buffer", "test_multitask_flush", "test_multitask_momentum_mode"]


def make_optimizer(family, legacy, kind):
    optimizers = family.optimizers(legacy)
    if kind == "sgd":
        return optimizers.SGD(1.0)
    if kind == "momentum":
        return optimizers.SGD(0.1, momentum=0.9)
    if kind == "adam":
        return optimizers.Adam(0.1)
    return optimizers.AdamW(0.1, weight_decay=0.1)


# ------------------------------------------------------------- minimal a/b


def run_minimal_sgd(family, legacy, missing, compile):
    """Variables a, b; SGD(1), k=2: both with gradients 2 and 4, then a alone with 6
    (b absent, or `None`). Returns the AccumOptimizer after its checks."""
    variable = tf.Variable if family.legacy else family.K.Variable
    a = variable(np.zeros(2, "float32"), name="a")
    b = variable(np.zeros(2, "float32"), name="b")
    opt = AccumOptimizer(make_optimizer(family, legacy, "sgd"), 2)
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
    return opt


# ------------------------------------------------------ multi-task, two heads


def multitask_model(K, seed=0):
    K.utils.set_random_seed(seed)
    trunk = K.layers.Dense(5, activation="tanh", name="trunk")
    head_a = K.layers.Dense(1, name="head_a", kernel_constraint=K.constraints.MaxNorm(0.5))
    head_b = K.layers.Dense(1, name="head_b")
    x = K.Input((4,))
    h = trunk(x)
    return K.Model(x, [head_a(h), head_b(h)]), trunk, head_a, head_b


def _loss(model, x, y, task):
    out_a, out_b = model(x)
    return tf.reduce_mean(tf.square((out_a if task == "a" else out_b) - y))


def data(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def run_accum(K, opt, tasks, b, compile, flush_at=None):
    """Micro-batches of `b`, each the loss of its task's head ("a" or "b")."""
    model, trunk, head_a, head_b = multitask_model(K)
    opt.build(model.trainable_variables)
    x, y = data(len(tasks) * b)

    def make(task):
        variables = trunk.trainable_variables + (head_a if task == "a" else head_b).trainable_variables

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _loss(model, xb, yb, task)
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        return tf.function(step) if compile else step

    steps = {"a": make("a"), "b": make("b")}
    for i, task in enumerate(tasks):
        steps[task](x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
        if flush_at is not None and i + 1 == flush_at:
            opt.flush()
    return model


def _build(opt, variables):
    if hasattr(opt, "inner_optimizer") or not hasattr(opt, "_create_all_weights"):
        opt.build(variables)
    else:
        opt._create_all_weights(variables)  # tf_keras's legacy optimizers


def run_reference(K, opt, tasks, k, b, flush_at=None):
    """One inner step per window on the mean of its micro-batch losses; variables with
    no gradient in the window are not passed (as at batch k*b)."""
    model, *_ = multitask_model(K)
    _build(opt, model.trainable_variables)
    x, y = data(len(tasks) * b)
    variables = model.trainable_variables
    windows, start = [], 0
    while start < len(tasks):
        stop = start + k
        if flush_at is not None and start < flush_at < stop:
            stop = flush_at
        windows.append((start, min(stop, len(tasks))))
        start = stop
    for start, stop in windows:
        if stop - start < k and stop != flush_at:
            break  # pending partial window: not applied
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [_loss(model, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], tasks[i]) for i in range(start, stop)]
            ) / (stop - start)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
    return model


def assert_same(family, ref_model, ref_opt, model, inner, tol=1e-6):
    """Weights, then the optimizer's state: per slot (legacy), or every variable."""
    for r, g in zip(ref_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)
    if family.legacy:  # tf_keras
        assert int(ref_opt.iterations) == int(inner.iterations)
    if hasattr(ref_opt, "get_slot_names"):
        for var_ref, var in zip(ref_model.trainable_variables, model.trainable_variables):
            for name in ref_opt.get_slot_names():
                np.testing.assert_allclose(
                    inner.get_slot(var, name).numpy(), ref_opt.get_slot(var_ref, name).numpy(),
                    rtol=tol, atol=tol,
                )
    else:
        ref_vars, got_vars = optimizer_variables(ref_opt), optimizer_variables(inner)
        assert len(ref_vars) == len(got_vars)
        for r, g in zip(ref_vars, got_vars):
            name = r.name if family.legacy else r.path
            np.testing.assert_allclose(np.array(g.numpy()), np.array(r.numpy()), rtol=tol, atol=tol, err_msg=name)


# alternating heads: every window touches both; "aabb": windows that touch one head only
SCHEDULES = {"abab": list("abababab"), "aabb": list("aabbaabb"), "aaab": list("aaabaaab")}


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("compile", [False, True])
def test_multitask_buffer(family, legacy, kind, schedule, compile):
    if legacy and kind == "adamw":
        pytest.skip("tf_keras has no legacy AdamW")
    k, b = 2, 3
    opt = AccumOptimizer(make_optimizer(family, legacy, kind), k)
    model = run_accum(family.K, opt, SCHEDULES[schedule], b, compile)
    ref_opt = make_optimizer(family, legacy, kind)
    ref = run_reference(family.K, ref_opt, SCHEDULES[schedule], k, b)
    assert_same(family, ref, ref_opt, model, opt.inner_optimizer)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("flush_at", [1, 3, 6])
def test_multitask_flush(family, legacy, kind, flush_at):
    tasks = list("aabbaab")
    k, b = 3, 2
    opt = AccumOptimizer(make_optimizer(family, legacy, kind), k)
    model = run_accum(family.K, opt, tasks, b, compile=True, flush_at=flush_at)
    ref_opt = make_optimizer(family, legacy, kind)
    ref = run_reference(family.K, ref_opt, tasks, k, b, flush_at=flush_at)
    assert_same(family, ref, ref_opt, model, opt.inner_optimizer)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_multitask_momentum_mode(family, legacy, schedule):
    """`mode="momentum"` with SGD momentum: exact, also for missing variables."""
    k, b = 2, 3
    opt = AccumOptimizer(make_optimizer(family, legacy, "momentum"), k, mode="momentum")
    model = run_accum(family.K, opt, SCHEDULES[schedule], b, compile=True)
    ref_opt = make_optimizer(family, legacy, "momentum")
    ref = run_reference(family.K, ref_opt, SCHEDULES[schedule], k, b)
    assert_same(family, ref, ref_opt, model, opt.inner_optimizer)
