"""Keras 3 `accum.BatchNormalization`: under an `AccumOptimizer`, the moving statistics of
the whole k*b batch (plain BatchNormalization at batch k*b, <= 1e-6), once per window, in
`fit`, custom loops, every mode, mixed precision, MirroredStrategy; Keras's layer otherwise."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import accum
from accum import AccumOptimizer
from tests.helpers.accum_batchnorm_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.accum_batchnorm_checks import check_mixed_float16, fit_without_accum_optimizer
from tests.helpers.accum_family_checks import keras3_family  # noqa: F401 (the fixture family)
from tests.helpers.bn_reference import (
    B, K, WINDOWS, assert_statistics_equal, bn_of, check_resume_in_fresh_process, fit_both, loop_both, make_data,
    make_model,
)


def inner(mode):
    return keras.optimizers.SGD(0.05, momentum=0.9) if mode == "momentum" else keras.optimizers.Adam(1e-2)


@pytest.mark.fast
@pytest.mark.parametrize("mode", ["buffer", "momentum", "rescale"])
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_fit_gives_big_batch_statistics(kind, mode):
    x, y = make_data(K * B * WINDOWS)
    model = make_model(keras, accum.BatchNormalization(momentum=0.8), kind)
    ref = make_model(keras, keras.layers.BatchNormalization(momentum=0.8), kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BatchNormalization warning for accum's layer
        fit_both(model, AccumOptimizer(inner(mode), K, mode=mode), ref, inner(mode), x, y)
    assert not np.any(np.asarray(bn_of(model).accum_count))  # window empty after its end


def test_partial_window_flushed_at_epoch_end():
    x, y = make_data(K * B * 2 + 2 * B)  # two windows and half a window per epoch
    model = make_model(keras, accum.BatchNormalization(), "sequential")
    ref = make_model(keras, keras.layers.BatchNormalization(), "sequential")
    opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K)
    model.compile(opt, "mse")
    ref.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[opt.flush_callback()])
    ref.fit(x, y, batch_size=K * B, epochs=2, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))


@pytest.mark.parametrize("compiled", [True, False])
def test_custom_loop(compiled):
    """`tf.function` (the optimizer is built while the first step is traced) and eager
    (the optimizer built before the first step)."""
    x, y = make_data(K * B * WINDOWS)
    model = make_model(keras, accum.BatchNormalization(), "functional")
    ref = make_model(keras, keras.layers.BatchNormalization(), "functional")
    opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K)
    if not compiled:
        opt.build(model.trainable_variables)

    loop_both(model, opt, ref, keras.optimizers.Adam(1e-2), x, y, compiled)


def test_eager_loop_without_building_first_warns():
    x, y = make_data(B)
    model = make_model(keras, accum.BatchNormalization(), "sequential")
    opt = AccumOptimizer(keras.optimizers.Adam(1e-2), K)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    with pytest.warns(UserWarning, match="Build the optimizer before the first step"):
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def test_without_accum_optimizer_it_is_keras_layer():
    model, ref, x = fit_without_accum_optimizer(keras)
    np.testing.assert_array_equal(ref.predict(x, verbose=0), model.predict(x, verbose=0))


def test_mixed_precision():
    """float16 inputs (statistics in float32, as Keras's layer). The loss-scale optimizer
    `fit` would add starts at 1: no step overflows, so none is skipped (a skipped step
    never reaches the wrapper, and its micro-batch stays in the layer's window)."""
    check_mixed_float16(keras, lambda optimizer: keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=1.0))


def test_save_mid_window_resume_in_fresh_process(tmp_path):
    model = make_model(keras, accum.BatchNormalization(), "functional")
    model.compile(AccumOptimizer(keras.optimizers.Adam(1e-2), K), "mse")
    check_resume_in_fresh_process(keras, model, str(tmp_path / "bn.keras"))

def test_keras_layer_warns_and_points_to_accum_layer():
    x, y = make_data(K * B)
    model = make_model(keras, keras.layers.BatchNormalization(), "sequential")
    model.compile(AccumOptimizer(keras.optimizers.Adam(), K), "mse")
    with pytest.warns(UserWarning, match="accum.BatchNormalization"):
        model.fit(x, y, batch_size=B, verbose=0)


def test_family_and_arguments():
    assert isinstance(accum.BatchNormalization(), keras.layers.BatchNormalization)
    assert isinstance(accum.BatchNormalization(), accum.BatchNormalization)
    import tf_keras

    assert isinstance(accum.BatchNormalization(family="tf_keras"), tf_keras.layers.BatchNormalization)
    with pytest.raises(ValueError, match="`family` must be"):
        accum.BatchNormalization(family="torch")
    with pytest.raises(ValueError, match="renorm=True"):
        accum.BatchNormalization(renorm=True)
    layer = accum.BatchNormalization(momentum=0.7, epsilon=1e-4)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(again) is type(layer) and again.momentum == 0.7
