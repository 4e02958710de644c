"""Keras 3 `accum.BatchNormalization`: under an `AccumOptimizer`, the moving statistics of
the whole k*b batch (plain BatchNormalization at batch k*b, <= 1e-6), once per window, in
`fit`, custom loops, every mode, mixed precision, MirroredStrategy; Keras's layer otherwise."""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import accum
from accum import AccumOptimizer
from tests.helpers.bn_reference import B, K, WINDOWS, assert_statistics_equal, make_data, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pair(kind="sequential", **bn):
    """(model with accum.BatchNormalization, reference with keras's), same weights."""
    model = make_model(keras, accum.BatchNormalization(**bn), kind)
    ref = make_model(keras, keras.layers.BatchNormalization(**bn), kind)
    return model, ref, model.layers[0] if kind != "sequential" or True else None


def bn_of(model):
    return [layer for layer in model._flatten_layers() if "BatchNormalization" in type(layer).__name__][0]


def inner(mode):
    return keras.optimizers.SGD(0.05, momentum=0.9) if mode == "momentum" else keras.optimizers.Adam(1e-2)


@pytest.mark.parametrize("mode", ["buffer", "momentum", "rescale"])
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_fit_gives_big_batch_statistics(kind, mode):
    x, y = make_data(K * B * WINDOWS)
    model = make_model(keras, accum.BatchNormalization(momentum=0.8), kind)
    ref = make_model(keras, keras.layers.BatchNormalization(momentum=0.8), kind)
    model.compile(AccumOptimizer(inner(mode), K, mode=mode), "mse")
    ref.compile(inner(mode), "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BatchNormalization warning for accum's layer
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))
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

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step = tf.function(step) if compiled else step
    for i in range(0, len(x), B):
        step(tf.constant(x[i:i + B]), tf.constant(y[i:i + B]))
    ref.compile(keras.optimizers.Adam(1e-2), "mse")
    ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))


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
        model.compile(scaled(AccumOptimizer(keras.optimizers.Adam(1e-2), K), initial_scale=1.0), "mse")
        ref.compile(scaled(keras.optimizers.Adam(1e-2), initial_scale=1.0), "mse")
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert bn_of(model).compute_dtype == "float16"
    assert_statistics_equal(bn_of(ref), bn_of(model))


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPUs")
def test_mirrored_strategy_reduces_statistics_once_per_window(mirrored_strategy):
    """Global statistics of the window (k * global batch), as a plain layer on one device
    at batch k * b: each replica's sums are read once, at the window's end."""
    x, y = make_data(K * B * WINDOWS)
    with mirrored_strategy.scope():
        model = make_model(keras, accum.BatchNormalization(), "sequential")
        model.compile(AccumOptimizer(keras.optimizers.SGD(0.01), K), "mse")
    ref = make_model(keras, keras.layers.BatchNormalization(), "sequential")
    ref.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model))


RESUME = r"""
import json, sys, numpy as np, keras, accum
from tests.helpers.bn_reference import make_data, B
path, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = keras.models.load_model(path)
x, y = make_data(stop * B)
for i in range(start, stop):
    model.train_on_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
bn = [l for l in model._flatten_layers() if "BatchNormalization" in type(l).__name__][0]
print(json.dumps([np.asarray(bn.moving_mean).tolist(), np.asarray(bn.moving_variance).tolist()]))
"""


def test_save_mid_window_resume_in_fresh_process(tmp_path):
    stop, total = K + 2, 3 * K  # saved with two micro-steps pending
    x, y = make_data(total * B)
    model = make_model(keras, accum.BatchNormalization(), "functional")
    model.compile(AccumOptimizer(keras.optimizers.Adam(1e-2), K), "mse")
    for i in range(total):
        if i == stop:
            path = str(tmp_path / "bn.keras")
            model.save(path)
            assert np.any(np.asarray(bn_of(model).accum_count))
        model.train_on_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
    out = subprocess.run(
        [sys.executable, "-c", RESUME, path, str(stop), str(total)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": "tensorflow"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    mean, variance = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_array_equal(np.asarray(bn_of(model).moving_mean), np.float32(mean))
    np.testing.assert_array_equal(np.asarray(bn_of(model).moving_variance), np.float32(variance))


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
