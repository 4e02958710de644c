"""tf_keras (new-style and legacy): a variable missing from some micro-steps counts a
zero gradient there; one untouched by a whole window is left alone; legacy optimizers
accept variables unfrozen after some training, as the plain legacy optimizer does.

Reference: the same inner optimizer fed the big batch (mean of the window's
micro-batch losses), which does not see a variable with no gradient in the window.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.tfk_reference import optimizer_variables


def _optimizer(family, kind):
    ns = K.optimizers.legacy if family == "legacy" else K.optimizers
    if kind == "sgd":
        return ns.SGD(1.0)
    if kind == "momentum":
        return ns.SGD(0.1, momentum=0.9)
    if kind == "adam":
        return ns.Adam(0.1)
    return ns.AdamW(0.1, weight_decay=0.1)


FAMILIES = ["new", "legacy"]


def _build(opt, variables):
    if hasattr(opt, "inner_optimizer") or not hasattr(opt, "_create_all_weights"):
        opt.build(variables)
    else:
        opt._create_all_weights(variables)


# ------------------------------------------------------------- minimal a/b


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("missing", ["absent", "none"])
@pytest.mark.parametrize("compile", [False, True])
def test_minimal_sgd(family, missing, compile):
    a = tf.Variable(np.zeros(2, "float32"), name="a")
    b = tf.Variable(np.zeros(2, "float32"), name="b")
    opt = AccumOptimizer(_optimizer(family, "sgd"), 2)
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


# ------------------------------------------------------ multi-task, two heads


def _multitask_model(seed=0):
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


def _data(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _run_accum(opt, tasks, b, compile, flush_at=None):
    model, trunk, head_a, head_b = _multitask_model()
    opt.build(model.trainable_variables)
    x, y = _data(len(tasks) * b)

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


def _run_reference(opt, tasks, k, b, flush_at=None):
    model, *_ = _multitask_model()
    _build(opt, model.trainable_variables)
    x, y = _data(len(tasks) * b)
    variables = model.trainable_variables
    bounds, start = [], 0
    while start < len(tasks):
        stop = start + k
        if flush_at is not None and start < flush_at < stop:
            stop = flush_at
        bounds.append((start, min(stop, len(tasks))))
        start = stop
    for start, stop in bounds:
        if stop - start < k and stop != flush_at:
            break  # pending partial window: not applied
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [_loss(model, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], tasks[i]) for i in range(start, stop)]
            ) / (stop - start)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
    return model


def _assert_same(ref_model, ref_opt, model, inner, tol=1e-6):
    for r, g in zip(ref_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)
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
            np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=tol, atol=tol, err_msg=r.name)


SCHEDULES = {"abab": list("abababab"), "aabb": list("aabbaabb"), "aaab": list("aaabaaab")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("compile", [False, True])
def test_multitask_buffer(family, kind, schedule, compile):
    if family == "legacy" and kind == "adamw":
        pytest.skip("tf_keras has no legacy AdamW")
    k, b = 2, 3
    opt = AccumOptimizer(_optimizer(family, kind), k)
    model = _run_accum(opt, SCHEDULES[schedule], b, compile)
    ref_opt = _optimizer(family, kind)
    ref = _run_reference(ref_opt, SCHEDULES[schedule], k, b)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("flush_at", [1, 3, 6])
def test_multitask_flush(family, kind, flush_at):
    tasks = list("aabbaab")
    k, b = 3, 2
    opt = AccumOptimizer(_optimizer(family, kind), k)
    model = _run_accum(opt, tasks, b, compile=True, flush_at=flush_at)
    ref_opt = _optimizer(family, kind)
    ref = _run_reference(ref_opt, tasks, k, b, flush_at=flush_at)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_multitask_momentum_mode(family, schedule):
    k, b = 2, 3
    opt = AccumOptimizer(_optimizer(family, "momentum"), k, mode="momentum")
    model = _run_accum(opt, SCHEDULES[schedule], b, compile=True)
    ref_opt = _optimizer(family, "momentum")
    ref = _run_reference(ref_opt, SCHEDULES[schedule], k, b)
    _assert_same(ref, ref_opt, model, opt.inner_optimizer)


# ------------------------------------------------------ freeze -> unfreeze


def _classifier(seed=0):
    K.utils.set_random_seed(seed)
    body = K.layers.Dense(6, activation="tanh", name="body")
    model = K.Sequential([K.Input((4,)), body, K.layers.Dense(1, name="top")])
    return model, body


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["buffer", "momentum"])
def test_legacy_unfreeze_matches_plain(kind, mode):
    """bert4keras-style: train the top with the body frozen, unfreeze, train on (fit,
    recompiling after the unfreeze). The wrapper creates buffers for the new variables
    and matches the plain legacy optimizer at batch k*b."""
    if mode == "momentum":
        if kind == "adam":
            pytest.skip("mode=\"momentum\" with Adam is approximate (see accum._momentum)")
        kind = "momentum"
    k, b = 2, 4
    x, y = _data(8 * k * b, seed=3)

    def train(model, body, optimizer, batch):
        body.trainable = False
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        body.trainable = True
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    def make():
        legacy = K.optimizers.legacy
        return {"sgd": legacy.SGD(0.05), "adam": legacy.Adam(0.01),
                "momentum": legacy.SGD(0.05, momentum=0.9)}[kind]

    model, body = _classifier()
    opt = AccumOptimizer(make(), k, mode=mode)
    train(model, body, opt, b)
    ref_model, ref_body = _classifier()
    ref_opt = make()
    train(ref_model, ref_body, ref_opt, k * b)
    _assert_same(ref_model, ref_opt, model, opt.inner_optimizer, tol=1e-5)
    assert int(opt.iterations) == 2 * len(x) // (k * b)


def test_new_style_unfreeze_refused_like_plain():
    """New-style tf_keras optimizers are built once for a fixed variable list: the plain
    optimizer refuses a variable it was not built with, and so does the wrapper."""
    x, y = _data(16, seed=3)
    for optimizer in (K.optimizers.SGD(0.1), AccumOptimizer(K.optimizers.SGD(0.1), 2)):
        model, body = _classifier()
        body.trainable = False
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        body.trainable = True
        model.compile(optimizer=optimizer, loss="mse")
        with pytest.raises((KeyError, ValueError), match="variable"):
            model.fit(x, y, batch_size=4, verbose=0)


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize("family", FAMILIES)
def test_refusals(family):
    ns = K.optimizers.legacy if family == "legacy" else K.optimizers
    with pytest.raises(ValueError, match=r"<= 2\*\*63 - 1 \(the window counters are int64\)"):
        AccumOptimizer(ns.SGD(), 2**63)
    inner = ns.Adam()
    opt = AccumOptimizer(inner, 4)
    with pytest.raises(AttributeError, match=r"`steps_per_update` is read-only"):
        opt.steps_per_update = 8
    assert opt.get_config()["steps_per_update"] == 4
    with pytest.raises(ValueError, match=r"`optimizer` is already wrapped by another `AccumOptimizer`"):
        AccumOptimizer(inner, 2)
    with pytest.raises(ValueError, match="already wrapped by another"):
        AccumOptimizer(K.mixed_precision.LossScaleOptimizer(inner), 2)
