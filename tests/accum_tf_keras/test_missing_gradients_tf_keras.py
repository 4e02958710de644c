"""tf_keras (new-style and legacy): a variable missing from some micro-steps counts a
zero gradient there; one untouched by a whole window is left alone; legacy optimizers
accept variables unfrozen after some training, as the plain legacy optimizer does.

Reference: the same inner optimizer fed the big batch (mean of the window's
micro-batch losses), which does not see a variable with no gradient in the window.
"""

import pytest
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.accum_missing_gradients_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.accum_missing_gradients_checks import assert_same, data, run_minimal_sgd


@pytest.mark.parametrize("missing", ["absent", "none"])
@pytest.mark.parametrize("compile", [False, True])
def test_minimal_sgd(family, legacy, missing, compile):
    run_minimal_sgd(family, legacy, missing, compile)


# ------------------------------------------------------ freeze -> unfreeze


def _classifier(seed=0):
    K.utils.set_random_seed(seed)
    body = K.layers.Dense(6, activation="tanh", name="body")
    model = K.Sequential([K.Input((4,)), body, K.layers.Dense(1, name="top")])
    return model, body


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["buffer", "momentum"])
def test_legacy_unfreeze_matches_plain(family, kind, mode):
    """bert4keras-style: train the top with the body frozen, unfreeze, train on (fit,
    recompiling after the unfreeze). The wrapper creates buffers for the new variables
    and matches the plain legacy optimizer at batch k*b."""
    if mode == "momentum":
        if kind == "adam":
            pytest.skip("mode=\"momentum\" with Adam is approximate (see accum.modes._momentum)")
        kind = "momentum"
    k, b = 2, 4
    x, y = data(8 * k * b, seed=3)

    def train(model, body, optimizer, batch):
        body.trainable = False
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        body.trainable = True
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    def make():
        legacy = K.optimizers.legacy
        return {"sgd": legacy.SGD(0.05), "adam": legacy.Adam(0.01),
                "momentum": legacy.SGD(0.05, momentum=0.9)}[kind]

    model, body = _classifier()
    opt = AccumOptimizer(make(), k, mode=mode)
    train(model, body, opt, b)
    ref_model, ref_body = _classifier()
    ref_opt = make()
    train(ref_model, ref_body, ref_opt, k * b)
    assert_same(family, ref_model, ref_opt, model, opt.inner_optimizer, tol=1e-5)
    assert int(opt.iterations) == 2 * len(x) // (k * b)


def test_new_style_unfreeze_refused_like_plain():
    """New-style tf_keras optimizers are built once for a fixed variable list: the plain
    optimizer refuses a variable it was not built with, and so does the wrapper."""
    x, y = data(16, seed=3)
    for optimizer in (K.optimizers.SGD(0.1), AccumOptimizer(K.optimizers.SGD(0.1), 2)):
        model, body = _classifier()
        body.trainable = False
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        body.trainable = True
        model.compile(optimizer=optimizer, loss="mse")
        with pytest.raises((KeyError, ValueError), match="variable"):
            model.fit(x, y, batch_size=4, verbose=0)


# ------------------------------------------------------------ refusals


def test_refusals(family, legacy):
    ns = family.optimizers(legacy)
    with pytest.raises(ValueError, match=r"<= 2\*\*63 - 1 \(the window counters are int64\)"):
        AccumOptimizer(ns.SGD(), 2**63)
    inner = ns.Adam()
    opt = AccumOptimizer(inner, 4)
    with pytest.raises(AttributeError, match=r"`steps_per_update` is read-only"):
        opt.steps_per_update = 8
    assert opt.get_config()["steps_per_update"] == 4
    with pytest.raises(ValueError, match=r"`optimizer` is already wrapped by another `AccumOptimizer`"):
        AccumOptimizer(inner, 2)
    with pytest.raises(ValueError, match="already wrapped by another"):
        AccumOptimizer(K.mixed_precision.LossScaleOptimizer(inner), 2)
