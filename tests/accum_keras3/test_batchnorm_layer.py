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
from tests.helpers.bn_reference import (
    B, K, SWITCHES, WINDOWS, assert_statistics_equal, bn_of, check_new_accum_optimizer_drops_window,
    check_optimizer_switches, check_resume_in_fresh_process, fit_both, loop_both, make_data, make_model,
)




def inner(mode):
    return keras.optimizers.SGD(0.05, momentum=0.9) if mode == "momentum" else keras.optimizers.Adam(1e-2)


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
    x, y = make_data(K * B)
    model = make_model(keras, accum.BatchNormalization(), "sequential")
    ref = make_model(keras, keras.layers.BatchNormalization(), "sequential")
    for m in (model, ref):
        m.compile(keras.optimizers.Adam(1e-2), "mse")
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model), tol=0.0)
    np.testing.assert_array_equal(ref.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("phases", SWITCHES, ids="-".join)
def test_optimizer_switches(phases):
    """Compiled again with a plain optimizer, the layer is Keras's again (a partial window
    of the AccumOptimizer dropped); with an AccumOptimizer (the same or a new one), the
    big batch's statistics again."""
    check_optimizer_switches(keras, phases, lambda: keras.optimizers.SGD(0.01))


def test_new_accum_optimizer_drops_the_window_of_the_previous():
    check_new_accum_optimizer_drops_window(keras)


def test_mixed_precision():
    """float16 inputs (statistics in float32, as Keras's layer). The loss-scale optimizer
    `fit` would add starts at 1: no step overflows, so none is skipped (a skipped step
    never reaches the wrapper, and its micro-batch stays in the layer's window)."""
    x, y = make_data(K * B * WINDOWS)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = make_model(keras, accum.BatchNormalization(), "sequential")
        ref = make_model(keras, keras.layers.BatchNormalization(), "sequential")
        scaled = keras.optimizers.LossScaleOptimizer
        fit_both(model, scaled(AccumOptimizer(keras.optimizers.Adam(1e-2), K), initial_scale=1.0),
                 ref, scaled(keras.optimizers.Adam(1e-2), initial_scale=1.0), x, y)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert bn_of(model).compute_dtype == "float16"


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPUs")
def test_mirrored_strategy_reduces_statistics_once_per_window(mirrored_strategy):
    """Global statistics of the window (k * global batch), as a plain layer on one device
    at batch k * b: each replica's sums are read once, at the window's end."""
    x, y = make_data(K * B * WINDOWS)
    with mirrored_strategy.scope():
        model = make_model(keras, accum.BatchNormalization(), "sequential")
        optimizer = AccumOptimizer(keras.optimizers.SGD(0.01), K)
    ref = make_model(keras, keras.layers.BatchNormalization(), "sequential")
    fit_both(model, optimizer, ref, keras.optimizers.SGD(0.01), x, y)


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
