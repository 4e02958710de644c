"""Keras 3: loss scaling on either side of AccumOptimizer; non-finite micro-batches skipped."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from tests.helpers.k3_reference import concat, make_data, make_dense_model, make_model, run_batches, state, twin
from tests.helpers.numerics import assert_grouped_close

K, B = 4, 3


def poisoned_data(n_micro, bad):
    x, ids, y = make_data(B * n_micro)
    y = y.copy()
    y[bad * B] = 3e38  # the squared error overflows float32: inf loss, non-finite gradients
    return x, ids, y


def scaled_step(model, optimizer):
    def step(x, ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([x, ids], training=True) - y))
            scaled = optimizer.scale_loss(loss)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))

    return step


def join(data, micro_indices):
    parts = [concat(data, i * B, (i + 1) * B) for i in micro_indices]
    return tuple(np.concatenate(p) for p in zip(*parts))


def check(model, inner, ref, ref_opt, windows, data):
    run_batches(ref, ref_opt, [join(data, w) for w in windows])
    assert int(inner.iterations) == len(windows)
    got, want = state(model, inner), state(ref, ref_opt)
    assert_grouped_close(want, got, 1e-6, [str(i) for i in range(len(want))], lambda n: "all")


def test_loss_scale_optimizer_outside():
    """LSO(AccumOptimizer): the LSO drops the bad micro-step; windows are k finite micro-steps."""
    data = poisoned_data(9, bad=2)
    model = make_model()
    ref = twin(model)
    inner = keras.optimizers.Adam(0.01)
    ref_opt = keras.optimizers.Adam(0.01)
    opt = keras.optimizers.LossScaleOptimizer(AccumOptimizer(inner, K), initial_scale=2.0**10)
    step = scaled_step(model, opt)
    for i in range(9):
        step(*concat(data, i * B, (i + 1) * B))
    assert float(opt.dynamic_scale) == 2.0**9
    check(model, inner, ref, ref_opt, [[0, 1, 3, 4], [5, 6, 7, 8]], data)


def test_loss_scale_optimizer_inside():
    """AccumOptimizer(LSO): the bad micro-batch is skipped, the mean divides by the 3 kept,
    and the inner scale is halved as the LSO would."""
    data = poisoned_data(8, bad=2)
    model = make_model()
    ref = twin(model)
    adam = keras.optimizers.Adam(0.01)
    ref_opt = keras.optimizers.Adam(0.01)
    lso = keras.optimizers.LossScaleOptimizer(adam, initial_scale=2.0**10)
    opt = AccumOptimizer(lso, K)
    assert float(opt.scale_loss(tf.constant(1.0))) == 2.0**10
    step = scaled_step(model, opt)
    for i in range(8):
        step(*concat(data, i * B, (i + 1) * B))
    assert float(lso.dynamic_scale) == 2.0**9
    assert int(opt.micro_steps) == 8
    check(model, adam, ref, ref_opt, [[0, 1, 3], [4, 5, 6, 7]], data)


@pytest.fixture
def mixed_float16():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy(previous)


def test_compile_under_mixed_float16_wraps_accum_in_loss_scale_optimizer(mixed_float16):
    x, ids, y = make_data(B * 8)
    model = make_dense_model()
    accum = AccumOptimizer(keras.optimizers.Adam(0.01), K)
    model.compile(accum, "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is accum
    before = model.get_weights()
    model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    # The LSO drops micro-steps that overflow float16 (the first ones, at scale 2**15).
    micro = int(accum.micro_steps)
    assert 10 <= micro <= 16 and int(model.optimizer.iterations) == micro // K
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert not np.array_equal(before[0], model.get_weights()[0])
