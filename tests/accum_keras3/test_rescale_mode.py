"""Keras 3 `mode="rescale"`: the documented recipe, no buffer, updates counted in windows."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from tests.helpers.k3_reference import batches, make_data, make_model, make_step, twin
from tests.helpers.numerics import assert_all_close
from tests.helpers.rescale_reference import IDS, OPTIMIZERS, rescaled_config, run_recipe

K, B, WINDOWS = 4, 3, 4


def build(name, kwargs):
    return getattr(keras.optimizers, name)(**kwargs)


@pytest.mark.parametrize("compile", [None, "function"])
@pytest.mark.parametrize("name,kwargs,coefficients,heavy_ball", OPTIMIZERS, ids=IDS)
def test_rescale_is_the_recipe(name, kwargs, coefficients, heavy_ball, compile):
    data = make_data(K * B * WINDOWS)
    model = make_model()
    ref = twin(model)
    inner = build(name, kwargs)
    opt = AccumOptimizer(inner, K, mode="rescale")
    step = make_step(model, opt, compile, dense=True)
    weights = []
    for j, batch in enumerate(batches(data, B)):
        step(*(tf.constant(a) for a in batch))
        weights.append([np.array(w) for w in model.get_weights()])
    ref_opt = inner.__class__.from_config(rescaled_config(inner, K, coefficients, heavy_ball))
    run_recipe(ref, ref_opt, make_step(ref, ref_opt, None, dense=True), list(batches(data, B)), K)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=2e-5)
    # The weights move at the last micro-step of each window only; iterations count updates.
    for j in range(1, len(weights)):
        moved = any(not np.array_equal(a, b) for a, b in zip(weights[j - 1], weights[j]))
        assert moved == ((j + 1) % K == 0), j
    assert int(inner.iterations) == WINDOWS
    assert int(opt.micro_steps) == K * WINDOWS
    # Config keeps the user's coefficients.
    for c in coefficients:
        assert opt.get_config()["inner_optimizer"]["config"][c] == kwargs.get(c, inner.get_config()[c])


@pytest.mark.parametrize("name,kwargs,coefficients,heavy_ball", OPTIMIZERS, ids=IDS)
def test_k1_is_the_inner_optimizer(name, kwargs, coefficients, heavy_ball):
    data = make_data(B * 5)
    model = make_model()
    ref = twin(model)
    opt = AccumOptimizer(build(name, kwargs), 1, mode="rescale")
    for m, o in ((model, opt), (ref, build(name, kwargs))):
        step = make_step(m, o, "function", dense=True)
        for batch in batches(data, B):
            step(*(tf.constant(a) for a in batch))
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=1e-6)


def test_no_per_parameter_variable_and_sparse_gradients():
    """Only scalar counters beside the inner optimizer's slots; embedding gradients
    (`IndexedSlices`) are scattered into the selected update, as dense ones."""
    data = make_data(K * B * 2)
    sparse, dense = make_model(), make_model()
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    opt = AccumOptimizer(inner, K, mode="rescale")
    opt2 = AccumOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), K, mode="rescale")
    for m, o, d in ((sparse, opt, False), (dense, opt2, True)):
        step = make_step(m, o, "function", dense=d)
        for batch in batches(data, B):
            step(*(tf.constant(a) for a in batch))
    assert_all_close(dense.get_weights(), sparse.get_weights(), rtol=1e-6)
    own = opt.variables[: len(opt.variables) - len(inner.variables)]
    assert all(tuple(v.shape) == () for v in own), [v.shape for v in own]
    assert opt.accumulators == [] and opt.touched == []


def test_schedule_counts_updates():
    """A learning-rate schedule sees the update count: the recipe with a schedule
    evaluated at `micro_step // k` gives the same weights."""

    class PerWindow(keras.optimizers.schedules.LearningRateSchedule):
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, step):
            return self.inner(step // K)

    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)
    data = make_data(K * B * WINDOWS)
    model = make_model()
    ref = twin(model)
    opt = AccumOptimizer(keras.optimizers.Adam(schedule), K, mode="rescale")
    step = make_step(model, opt, "function", dense=True)
    for batch in batches(data, B):
        step(*(tf.constant(a) for a in batch))
    b1, b2 = 1 - 0.1 / K, 1 - 0.001 / K
    ref_opt = keras.optimizers.Adam(PerWindow(schedule), beta_1=b1, beta_2=b2)
    run_recipe(ref, ref_opt, make_step(ref, ref_opt, None, dense=True), list(batches(data, B)), K)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=2e-5)


def test_missing_gradient_counts_zero():
    """A variable without a gradient in a micro-step gets a zero gradient there
    (its averages decay), the same as being fed zeros."""
    data = make_data(K * B * 2)
    model, twin_model = make_model(), make_model()
    opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K, mode="rescale")
    opt2 = AccumOptimizer(keras.optimizers.Adam(1e-2), K, mode="rescale")
    for j, (x, ids, y) in enumerate(batches(data, B)):
        for m, o, drop in ((model, opt, True), (twin_model, opt2, False)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m([x, ids], training=True) - y))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, m.trainable_variables)]
            pairs = list(zip(grads, m.trainable_variables))
            if j % 3 == 1:  # the last layer gets no gradient in this micro-step
                if drop:
                    pairs = pairs[:-2]
                else:
                    pairs = [(g, v) for g, v in pairs[:-2]] + [(tf.zeros_like(g), v) for g, v in pairs[-2:]]
            o.apply_gradients(pairs)
    assert_all_close(twin_model.get_weights(), model.get_weights(), rtol=1e-6)


def test_fit_matches_custom_loop():
    """`fit` trains as a custom loop does (a non-finite micro-step: tests/helpers/accum_family_checks.py)."""
    data = make_data(K * B * 2)
    x, ids, y = data
    model = make_model()
    ref = twin(model)
    opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K, mode="rescale")
    model.compile(optimizer=opt, loss="mse")
    model.fit([x, ids], y, batch_size=B, shuffle=False, verbose=0)
    ref_opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K, mode="rescale")
    step = make_step(ref, ref_opt, None)
    for batch in batches(data, B):
        step(*(tf.constant(a) for a in batch))
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=1e-5)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: keras.optimizers.Adagrad(), "Adagrad keeps no moving average"),
        (lambda: keras.optimizers.Ftrl(), "Ftrl keeps no moving average"),
        (lambda: keras.optimizers.Muon(), "Muon keeps no moving average"),
        (lambda: keras.optimizers.SGD(0.1), "SGD with momentum=0.0 keeps no moving average"),
        (lambda: keras.optimizers.Adam(use_ema=True), "use_ema"),
        (lambda: keras.optimizers.Adam(beta_1=lambda: 0.9), "must be a number"),
    ],
    ids=["adagrad", "ftrl", "muon", "sgd", "ema", "callable"],
)
def test_refuses_what_it_cannot_rescale(make, match):
    with pytest.raises(ValueError, match=match) as info:
        AccumOptimizer(make(), 4, mode="rescale")
    assert 'mode="buffer"' in str(info.value) and "Received: optimizer=" in str(info.value)


@pytest.mark.parametrize(
    "make", [lambda: keras.optimizers.RMSprop(), keras.optimizers.Adadelta, keras.optimizers.Adafactor],
    ids=["rmsprop", "adadelta", "adafactor"],
)
def test_warns_where_the_weights_move_by_the_current_gradient(make):
    """Accepted (their moving averages are rescaled), with a warning: only the window's last
    micro-gradient moves the weights (the recipe test above checks the arithmetic)."""
    with pytest.warns(UserWarning, match="only the window's last micro-gradient"):
        AccumOptimizer(make(), 4, mode="rescale")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AccumOptimizer(keras.optimizers.RMSprop(momentum=0.5), 4, mode="rescale")


def test_flush_is_refused():
    opt = AccumOptimizer(keras.optimizers.Adam(), 4, mode="rescale")
    with pytest.raises(ValueError, match='`flush\\(\\)` needs `mode="buffer"`'):
        opt.flush()
    with pytest.raises(ValueError, match="rescale"):
        opt.flush_callback()


def test_config_round_trip():
    opt = AccumOptimizer(keras.optimizers.Lion(1e-3, beta_1=0.95), 8, mode="rescale")
    again = AccumOptimizer.from_config(opt.get_config())
    assert again.mode == "rescale" and again.steps_per_update == 8
    assert again.inner_optimizer.beta_1 == 0.95
