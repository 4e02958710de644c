"""tf_keras: AccumOptimizer(LossScaleOptimizer(opt)): a non-finite micro-batch is skipped,
the mean divides by the micro-batches kept, and the loss scale is halved."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.numerics import assert_grouped_close
from tests.helpers.tfk_reference import concat, make_data, make_model, run_batches, state, twin

KK, B = 4, 3


def join(data, micro):
    parts = [concat(data, i * B, (i + 1) * B) for i in micro]
    return tuple(np.concatenate(p) for p in zip(*parts))


@pytest.mark.parametrize("legacy", [False, True])
def test_loss_scale_optimizer_inside(legacy):
    x, ids, y = make_data(B * 8)
    y = y.copy()
    y[2 * B] = 3e38  # micro-batch 2 overflows float32
    data = (x, ids, y)
    module = K.optimizers.legacy if legacy else K.optimizers
    model = make_model()
    ref = twin(model)
    adam, ref_opt = module.Adam(0.01), module.Adam(0.01)
    lso = K.mixed_precision.LossScaleOptimizer(adam, initial_scale=2.0**10)
    opt = AccumOptimizer(lso, KK)
    for i in range(8):
        bx, bi, by = concat(data, i * B, (i + 1) * B)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([bx, bi], training=True) - by))
            scaled = opt.get_scaled_loss(loss)
        variables = model.trainable_variables
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
        opt.apply_gradients(zip(grads, variables))
    assert float(lso.loss_scale) == 2.0**9
    assert int(adam.iterations) == 2 and int(opt.micro_steps) == 8
    run_batches(ref, ref_opt, [join(data, [0, 1, 3]), join(data, [4, 5, 6, 7])])
    want, got = state(ref, ref_opt), state(model, adam)
    assert_grouped_close(want, got, 1e-6, [str(i) for i in range(len(want))], lambda n: "all", floor_fraction=1.0)


def test_compile_under_mixed_float16():
    """compile wraps the AccumOptimizer in tf_keras's LossScaleOptimizer; fit trains."""
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, ids, y = make_data(B * 8)
        model = make_model(embedding=False)
        accum = AccumOptimizer(K.optimizers.Adam(0.01), KK)
        model.compile(accum, "mse")
        assert model.optimizer.inner_optimizer is accum
        before = model.get_weights()
        model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        assert int(accum.micro_steps) >= 8
        assert all(np.all(np.isfinite(w)) for w in model.get_weights())
        assert not np.array_equal(before[0], model.get_weights()[0])
    finally:
        K.mixed_precision.set_global_policy("float32")
