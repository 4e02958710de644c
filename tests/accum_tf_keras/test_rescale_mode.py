"""tf_keras `mode="rescale"`: the documented recipe with new-style optimizers; legacy refused."""

import numpy as np
import pytest
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.numerics import assert_all_close
from tests.helpers.rescale_reference import IDS, OPTIMIZERS, rescaled_config, run_recipe
from tests.helpers.tfk_reference import concat, make_data, make_model, make_step, twin

KS, B, WINDOWS = 4, 3, 4


def micro_batches(data, size):
    return [concat(data, s, s + size) for s in range(0, len(data[0]) - size + 1, size)]


@pytest.mark.parametrize("compile", [None, "function"])
@pytest.mark.parametrize("name,kwargs,coefficients,heavy_ball", OPTIMIZERS, ids=IDS)
def test_rescale_is_the_recipe(name, kwargs, coefficients, heavy_ball, compile):
    if not hasattr(K.optimizers, name):
        pytest.skip(f"tf_keras has no {name}")
    data = make_data(KS * B * WINDOWS)
    model = make_model()
    ref = twin(model)
    inner = getattr(K.optimizers, name)(**kwargs)
    opt = AccumOptimizer(inner, KS, mode="rescale")
    step = make_step(model, opt, compile, dense=True)
    moves = []
    for batch in micro_batches(data, B):
        before = [np.array(w) for w in model.get_weights()]
        step(*batch)
        moves.append(any(not np.array_equal(a, w) for a, w in zip(before, model.get_weights())))
    ref_opt = inner.__class__.from_config(rescaled_config(inner, KS, coefficients, heavy_ball))
    run_recipe(ref, ref_opt, make_step(ref, ref_opt, compile, dense=True), micro_batches(data, B), KS)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=2e-5)
    assert moves == [(j + 1) % KS == 0 for j in range(KS * WINDOWS)]
    assert int(inner.iterations) == WINDOWS and int(opt.micro_steps) == KS * WINDOWS
    assert opt.accumulators == [] and opt.touched == []


def test_fit_matches_custom_loop():
    data = make_data(KS * B * 2)
    x, ids, y = data
    model = make_model()
    ref = twin(model)
    model.compile(optimizer=AccumOptimizer(K.optimizers.Adam(1e-2), KS, mode="rescale"), loss="mse")
    model.fit([x, ids], y, batch_size=B, shuffle=False, verbose=0)
    ref_opt = AccumOptimizer(K.optimizers.Adam(1e-2), KS, mode="rescale")
    step = make_step(ref, ref_opt, None)
    for batch in micro_batches(data, B):
        step(*batch)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=1e-5)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: K.optimizers.Adagrad(), "Adagrad keeps no moving average"),
        (lambda: K.optimizers.Ftrl(), "Ftrl keeps no moving average"),
        (lambda: K.optimizers.SGD(0.1), "momentum=0.0"),
        (lambda: K.optimizers.legacy.Adam(), "legacy optimizers"),
    ],
    ids=["adagrad", "ftrl", "sgd", "legacy"],
)
def test_refuses_what_it_cannot_rescale(make, match):
    with pytest.raises(ValueError, match=match):
        AccumOptimizer(make(), 4, mode="rescale")
