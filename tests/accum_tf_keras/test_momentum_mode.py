"""tf_keras `mode="momentum"`: exact for SGD with momentum (new-style and legacy); Adam's moments."""

import numpy as np
import pytest
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.numerics import assert_grouped_close
from tests.helpers import tfk_reference
from tests.helpers.accum_runs import micro_gradients, run_micro_batches, train_both
from tests.helpers.tfk_reference import make_data, make_model, optimizer_variables

KK, B, UPDATES = 4, 3, 6
SCHEDULE = lambda: K.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)  # noqa: E731


@pytest.mark.parametrize("compile", [None, "function"])
@pytest.mark.parametrize(
    "make_inner",
    [lambda: K.optimizers.SGD(0.05, momentum=0.9),
     lambda: K.optimizers.SGD(SCHEDULE(), momentum=0.5, weight_decay=0.1),
     lambda: K.optimizers.legacy.SGD(0.05, momentum=0.9),
     lambda: K.optimizers.legacy.SGD(SCHEDULE(), momentum=0.5)],
    ids=["sgd", "sgd_schedule_wd", "legacy_sgd", "legacy_sgd_schedule"],
)
def test_sgd_momentum_is_exact_with_no_buffer(make_inner, compile):
    model, opt, ref, ref_opt = train_both(tfk_reference, make_inner, KK, B, UPDATES, compile=compile, mode="momentum")
    inner = opt.inner_optimizer
    assert int(inner.iterations) == UPDATES and opt.accumulators == []
    got, want = optimizer_variables(inner), optimizer_variables(ref_opt)
    assert_grouped_close(
        ref.get_weights() + [v.numpy() for v in want],
        model.get_weights() + [v.numpy() for v in got],
        1e-6,
        [w.name for w in model.weights] + [f"{i}:{v.name}" for i, v in enumerate(got)],
        lambda n: "slot" if n[0].isdigit() else "weights",
        floor_fraction=1.0,
    )


@pytest.mark.parametrize("legacy", [False, True])
def test_adam_moments_after_one_window(legacy):
    data = make_data(KK * B)
    model = make_model()
    variables = model.trainable_variables
    micro = micro_gradients(model, data, KK, B)
    before = [v.numpy() for v in variables]
    inner = (K.optimizers.legacy.Adam if legacy else K.optimizers.Adam)(0.01)
    opt = AccumOptimizer(inner, KK, mode="momentum")
    run_micro_batches(model, opt, data, KK, B)
    assert int(inner.iterations) == 1
    alpha = 0.01 * np.sqrt(1 - 0.999) / (1 - 0.9)
    for j, var in enumerate(variables):
        g = np.stack([mg[j] for mg in micro])
        m = 0.1 * g.mean(0)
        v = 0.001 * (g**2).mean(0)
        np.testing.assert_allclose(var.numpy(), before[j] - alpha * m / (np.sqrt(v) + 1e-7), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "inner, match",
    [
        (lambda: K.optimizers.SGD(0.1), "momentum=0"),
        (lambda: K.optimizers.legacy.SGD(0.1, momentum=0.9, nesterov=True), "nesterov"),
        (lambda: K.optimizers.legacy.RMSprop(0.1), "not SGD, Adam or AdamW"),
        (lambda: K.optimizers.Adam(0.1, global_clipnorm=1.0), "global_clipnorm"),
        (lambda: K.optimizers.legacy.Adam(0.1, amsgrad=True), "amsgrad"),
    ],
)
def test_unsupported_optimizers_raise(inner, match):
    with pytest.raises(ValueError, match=match):
        AccumOptimizer(inner(), 4, mode="momentum")
