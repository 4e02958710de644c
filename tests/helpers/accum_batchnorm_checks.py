"""`accum.BatchNormalization` checks the same in both Keras families: MirroredStrategy,
switching optimizers, the layer without an AccumOptimizer. `family` (fixture,
tests.helpers.accum_family_checks) is Keras 3 or tf_keras;
tests/accum_keras3/test_batchnorm_layer.py and tests/accum_tf_keras/test_batchnorm_layer.py
import the tests and add their family's own.
"""

import pytest
import tensorflow as tf

import accum
from accum import AccumOptimizer
from tests.helpers.bn_reference import (
    B, SWITCHES, WINDOWS, assert_statistics_equal, bn_of, check_new_accum_optimizer_drops_window,
    check_optimizer_switches, fit_both, make_data, make_model,
)
from tests.helpers.bn_reference import K as STEPS

__all__ = [
    "test_mirrored_strategy_reduces_statistics_once_per_window",
    "test_new_accum_optimizer_drops_the_window_of_the_previous",
    "test_optimizer_switches",
]


def accum_layer(K, **kwargs):
    """`accum.BatchNormalization` of the family `K`, given explicitly: made here, the layer
    would take its family from this module, which imports no Keras (its choice by the
    calling module is tested in each suite)."""
    return accum.BatchNormalization(family="tf_keras" if K.__name__ == "tf_keras" else "keras3", **kwargs)


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPUs")
def test_mirrored_strategy_reduces_statistics_once_per_window(family, mirrored_strategy):
    """Global statistics of the window (k * global batch), as a plain layer on one device
    at batch k * b: each replica's sums are read once, at the window's end."""
    K = family.K
    x, y = make_data(STEPS * B * WINDOWS)
    with mirrored_strategy.scope():
        model = make_model(K, accum_layer(K), "sequential")
        optimizer = AccumOptimizer(K.optimizers.SGD(0.01), STEPS)
    ref = make_model(K, K.layers.BatchNormalization(), "sequential")
    fit_both(model, optimizer, ref, K.optimizers.SGD(0.01), x, y)


@pytest.mark.parametrize("phases", SWITCHES, ids="-".join)
def test_optimizer_switches(family, phases):
    """Compiled again with a plain optimizer, the layer is the family's again (a partial
    window of the AccumOptimizer dropped); with an AccumOptimizer (the same or a new
    one), the big batch's statistics again."""
    check_optimizer_switches(family.K, phases, lambda: family.K.optimizers.SGD(0.01))


def test_new_accum_optimizer_drops_the_window_of_the_previous(family):
    check_new_accum_optimizer_drops_window(family.K)


def fit_without_accum_optimizer(K):
    """`accum.BatchNormalization` and the family's layer fitted by a plain Adam: the same
    statistics. Returns (model, ref, x)."""
    x, y = make_data(STEPS * B)
    model = make_model(K, accum_layer(K), "sequential")
    ref = make_model(K, K.layers.BatchNormalization(), "sequential")
    for m in (model, ref):
        m.compile(K.optimizers.Adam(1e-2), "mse")
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_statistics_equal(bn_of(ref), bn_of(model), tol=0.0)
    return model, ref, x



def check_mixed_float16(K, loss_scale):
    """Under mixed_float16, `accum.BatchNormalization` with an AccumOptimizer (Adam)
    matches the family's layer at batch k*b; `loss_scale` wraps each optimizer in the
    family's loss-scale optimizer (its scale 1: no step is skipped)."""
    x, y = make_data(STEPS * B * WINDOWS)
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(K, accum_layer(K), "sequential")
        ref = make_model(K, K.layers.BatchNormalization(), "sequential")
        fit_both(model, loss_scale(AccumOptimizer(K.optimizers.Adam(1e-2), STEPS)),
                 ref, loss_scale(K.optimizers.Adam(1e-2)), x, y)
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert bn_of(model).compute_dtype == "float16"
