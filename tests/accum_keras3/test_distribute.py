"""Keras 3 under `MirroredStrategy` (2 logical CPUs): fit with AccumOptimizer equals batch k*b.

Keras's built-in `gradient_accumulation_steps` crashes here in graph mode
(keras-team/keras#20582): `merge_call` inside a `tf.cond`.
"""

import keras
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from k3_reference import fresh, make_data, make_dense_model, make_model, state
from numerics import assert_grouped_close

K, B = 4, 6  # B: global micro-batch, 3 per replica

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPU devices (see conftest.py)"
)


@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.mark.parametrize(
    "make_model_, make_inner",
    [
        (make_dense_model, lambda: keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5)),
        (make_model, lambda: keras.optimizers.SGD(0.05, momentum=0.9)),  # sparse embedding gradients
    ],
    ids=["adam_dense", "sgd_momentum_embedding"],
)
def test_mirrored_fit_matches_big_batch(make_model_, make_inner, strategy):
    """The reference is the inner optimizer at batch k*b on one device (Keras's
    own optimizers clip per replica under a strategy, which is not batch k*b)."""
    x, ids, y = make_data(K * B * 3)
    ref = make_model_()
    ref_opt = make_inner()
    ref.compile(ref_opt, "mse")
    with strategy.scope():
        model = make_model_()
        model.set_weights(ref.get_weights())
        inner = fresh(ref_opt)
        model.compile(AccumOptimizer(inner, K), "mse")
    model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    ref.fit([x, ids], y, batch_size=K * B, epochs=2, shuffle=False, verbose=0)
    assert int(inner.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 6
    want, got = state(ref, ref_opt), state(model, inner)
    assert_grouped_close(want, got, 1e-6, [str(i) for i in range(len(want))], lambda n: "all", floor_fraction=1.0)
