"""tf_keras `accum.BatchNormalization`: the moving statistics of the whole k*b batch (plain
tf_keras BatchNormalization at batch k*b, <= 1e-6), for dense and convolutional (fused) inputs,
in `fit` (every mode), custom loops, mixed precision, MirroredStrategy, saved mid-window."""

import pytest
import tensorflow as tf
import tf_keras as K

import accum
from accum import AccumOptimizer
from tests.helpers.bn_reference import (
    B, SWITCHES, WINDOWS, assert_statistics_equal, bn_of, check_new_accum_optimizer_drops_window,
    check_optimizer_switches, check_resume_in_fresh_process, fit_both, loop_both, make_data, make_model,
)
from tests.helpers.bn_reference import K as STEPS

IMAGE = (4, 4, 3)



def inner(mode):
    return K.optimizers.SGD(0.05, momentum=0.9) if mode == "momentum" else K.optimizers.Adam(1e-2)


def test_family_follows_the_calling_module():
    layer = accum.BatchNormalization()
    assert isinstance(layer, K.layers.BatchNormalization) and isinstance(layer, accum.BatchNormalization)


@pytest.mark.parametrize("mode", ["buffer", "momentum", "rescale"])
@pytest.mark.parametrize("shape", [(5,), IMAGE], ids=["dense", "conv_fused"])
def test_fit_gives_big_batch_statistics(shape, mode):
    x, y = make_data(STEPS * B * WINDOWS, shape=shape)
    model = make_model(K, accum.BatchNormalization(momentum=0.8), "functional", shape)
    ref = make_model(K, K.layers.BatchNormalization(momentum=0.8), "functional", shape)
    fit_both(model, AccumOptimizer(inner(mode), STEPS, mode=mode), ref, inner(mode), x, y)


def test_custom_loop_in_tf_function():
    x, y = make_data(STEPS * B * WINDOWS)
    model = make_model(K, accum.BatchNormalization(), "subclassed")
    ref = make_model(K, K.layers.BatchNormalization(), "subclassed")
    opt = AccumOptimizer(K.optimizers.Adam(1e-2), STEPS)

    loop_both(model, opt, ref, K.optimizers.Adam(1e-2), x, y)


def test_mixed_precision():
    """float16 inputs; the loss-scale optimizer has a fixed scale of 1, so no step is skipped."""
    x, y = make_data(STEPS * B * WINDOWS)
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(K, accum.BatchNormalization(), "sequential")
        ref = make_model(K, K.layers.BatchNormalization(), "sequential")
        lso = K.mixed_precision.LossScaleOptimizer
        fit_both(model, lso(AccumOptimizer(K.optimizers.Adam(1e-2), STEPS), dynamic=False, initial_scale=1.0),
                 ref, lso(K.optimizers.Adam(1e-2), dynamic=False, initial_scale=1.0), x, y)
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert bn_of(model).compute_dtype == "float16"


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPUs")
def test_mirrored_strategy_reduces_statistics_once_per_window(mirrored_strategy):
    x, y = make_data(STEPS * B * WINDOWS)
    with mirrored_strategy.scope():
        model = make_model(K, accum.BatchNormalization(), "sequential")
        optimizer = AccumOptimizer(K.optimizers.SGD(0.01), STEPS)
    ref = make_model(K, K.layers.BatchNormalization(), "sequential")
    fit_both(model, optimizer, ref, K.optimizers.SGD(0.01), x, y)


@pytest.mark.parametrize("suffix", ["keras", "h5"])
def test_save_mid_window_resume_in_fresh_process(tmp_path, suffix):
    model = make_model(K, accum.BatchNormalization(), "functional")
    model.compile(AccumOptimizer(K.optimizers.Adam(1e-2), STEPS), "mse")
    check_resume_in_fresh_process(K, model, str(tmp_path / f"bn.{suffix}"))

def test_without_accum_optimizer_it_is_keras_layer():
    x, y = make_data(STEPS * B)
    model = make_model(K, accum.BatchNormalization(), "sequential")
    ref = make_model(K, K.layers.BatchNormalization(), "sequential")
    for m in (model, ref):
        m.compile(K.optimizers.Adam(1e-2), "mse")
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model), tol=0.0)


@pytest.mark.parametrize("phases", SWITCHES, ids="-".join)
def test_optimizer_switches(phases):
    """Compiled again with a plain optimizer, the layer is tf_keras's again (a partial window
    of the AccumOptimizer dropped); with an AccumOptimizer (the same or a new one), the
    big batch's statistics again."""
    check_optimizer_switches(K, phases, lambda: K.optimizers.SGD(0.01))


def test_new_accum_optimizer_drops_the_window_of_the_previous():
    check_new_accum_optimizer_drops_window(K)
