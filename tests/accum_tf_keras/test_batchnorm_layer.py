"""tf_keras `accum.BatchNormalization`: the moving statistics of the whole k*b batch (plain
tf_keras BatchNormalization at batch k*b, <= 1e-6), for dense and convolutional (fused) inputs,
in `fit` (every mode), custom loops, mixed precision, MirroredStrategy, saved mid-window."""

import pytest
import tf_keras as K

import accum
from accum import AccumOptimizer
from tests.helpers.accum_batchnorm_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.accum_batchnorm_checks import check_mixed_float16, fit_without_accum_optimizer
from tests.helpers.bn_reference import B, WINDOWS, check_resume_in_fresh_process, fit_both, loop_both, make_data
from tests.helpers.bn_reference import K as STEPS
from tests.helpers.bn_reference import make_model

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
    lso = K.mixed_precision.LossScaleOptimizer
    check_mixed_float16(K, lambda optimizer: lso(optimizer, dynamic=False, initial_scale=1.0))


@pytest.mark.parametrize("suffix", ["keras", "h5"])
def test_save_mid_window_resume_in_fresh_process(tmp_path, suffix):
    model = make_model(K, accum.BatchNormalization(), "functional")
    model.compile(AccumOptimizer(K.optimizers.Adam(1e-2), STEPS), "mse")
    check_resume_in_fresh_process(K, model, str(tmp_path / f"bn.{suffix}"))


def test_without_accum_optimizer_it_is_keras_layer():
    fit_without_accum_optimizer(K)
