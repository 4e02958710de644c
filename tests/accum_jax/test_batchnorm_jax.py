"""`accum.BatchNormalization` on Keras 3's JAX backend, where no `AccumOptimizer` links it
(refused when built: tests/accum_jax/test_rescale_jax.py): under a plain optimizer it is
Keras's BatchNormalization in (jitted) `fit`."""

import keras
import numpy as np

import accum
from tests.helpers.bn_reference import B, K, TOL, WINDOWS, assert_statistics_equal, bn_of, make_data, make_model


def test_plain_optimizer_is_keras_layer():
    """Was: `AttributeError: 'str' object has no attribute '_error_repr'` (the link flag,
    a traced value, used as a Python bool)."""
    x, y = make_data(K * B * WINDOWS)
    model = make_model(keras, accum.BatchNormalization(momentum=0.8, dtype="float32"), "functional")
    ref = make_model(keras, keras.layers.BatchNormalization(momentum=0.8, dtype="float32"), "functional")
    for m in (model, ref):
        m.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", jit_compile=True)
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))
    for want, got in zip(ref.trainable_weights, model.trainable_weights):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL, err_msg=want.name)
    np.testing.assert_allclose(model.predict(x, verbose=0), ref.predict(x, verbose=0), rtol=TOL, atol=TOL)
