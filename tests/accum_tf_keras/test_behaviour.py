"""tf_keras (new-style and legacy): fit, callbacks, flush, state, warnings, bad input."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

from accum import AccumOptimizer
from tests.helpers.numerics import assert_grouped_close
from tests.helpers import tfk_reference
from tests.helpers.accum_runs import fit_with_lr_callback, resume_keras_file_mid_window
from tests.helpers.tfk_reference import (
    concat,
    fresh,
    make_data,
    make_model,
    make_step,
    run_batches,
    state,
    state_by_variable,
    twin,
)

KK, B = 4, 3
FAMILIES = {
    "new": lambda lr=0.05: K.optimizers.SGD(lr, momentum=0.9),
    "legacy": lambda lr=0.05: K.optimizers.legacy.SGD(lr, momentum=0.9),
}


def assert_states_close(ref, got, tol=1e-6):
    assert_grouped_close(ref, got, tol, [str(i) for i in range(len(ref))], lambda n: "all")


def micro_batches(data, start, stop):
    return [concat(data, i * B, (i + 1) * B) for i in range(start, stop)]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_bad_steps_per_update(bad):
    for make in FAMILIES.values():
        with pytest.raises(ValueError, match=r"`steps_per_update` must be an integer >= 1\. Received"):
            AccumOptimizer(make(), bad)


def test_bad_mode_and_double_wrap():
    for make in FAMILIES.values():
        with pytest.raises(ValueError, match="`mode` must be one of"):
            AccumOptimizer(make(), 2, mode="sum")
        with pytest.raises(ValueError, match="already an `AccumOptimizer`"):
            AccumOptimizer(AccumOptimizer(make(), 2), 2)
    with pytest.raises(ValueError, match="must be a Keras 3 or tf_keras optimizer"):
        AccumOptimizer(K.layers.Dense(1), 2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_types_and_config_round_trip(family):
    inner = FAMILIES[family]()
    opt = AccumOptimizer(inner, 8, name="acc")
    base = K.optimizers.legacy.Optimizer if family == "legacy" else K.optimizers.Optimizer
    assert isinstance(opt, base) and isinstance(opt, AccumOptimizer) and opt.inner_optimizer is inner
    config = opt.get_config()
    for restored in (
        AccumOptimizer.from_config(config),
        K.optimizers.deserialize(K.optimizers.serialize(opt), use_legacy_optimizer=family == "legacy"),
    ):
        assert type(restored) is type(opt)
        assert restored.steps_per_update == 8 and type(restored.inner_optimizer) is type(inner)
        assert restored.get_config() == config
    opt.learning_rate = 0.25
    assert float(K.backend.get_value(inner.learning_rate)) == 0.25


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fit_matches_big_batch_with_lr_callback(family):
    inner = FAMILIES[family]()
    model, ref, ref_opt = fit_with_lr_callback(tfk_reference, K, inner, KK, B)
    assert int(model.optimizer.iterations) == 12
    assert float(K.backend.get_value(inner.learning_rate)) == pytest.approx(0.0125)
    assert_states_close(state(ref, ref_opt), state(model, inner))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flush_callback_at_epoch_end(family):
    data = make_data(B * 5)
    x, ids, y = data
    model = make_model(embedding=False)
    ref = twin(model)
    inner = FAMILIES[family]()
    ref_opt = fresh(inner)
    opt = AccumOptimizer(inner, KK)
    model.compile(opt, "mse")
    model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[opt.flush_callback()])
    run_batches(ref, ref_opt, [concat(data, 0, 4 * B), concat(data, 4 * B, 5 * B)] * 2)
    assert int(opt.iterations) == 4 and int(opt.window_steps) == 0
    assert_states_close(state(ref, ref_opt), state(model, inner))


def test_new_style_fit_warns_once_about_pending_window():
    x, ids, y = make_data(B * 5)
    model = make_model(embedding=False)
    opt = AccumOptimizer(FAMILIES["new"](), KK)
    model.compile(opt, "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert len([w for w in caught if "pending" in str(w.message)]) == 1
    assert int(opt.iterations) == 2 and int(opt.window_steps) == 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_normalization_warning(family):
    x, ids, y = make_data(B * 4)
    for batch_norm in (True, False):
        model = make_model(batch_norm=batch_norm)
        model.compile(AccumOptimizer(FAMILIES[family](), KK), "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit([x, ids], y, batch_size=B, epochs=1, verbose=0)
        assert len([w for w in caught if "BatchNormalization" in str(w.message)]) == int(batch_norm)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_resume_mid_window_is_bit_exact(family, tmp_path):
    make = lambda: AccumOptimizer(  # noqa: E731
        (K.optimizers.legacy if family == "legacy" else K.optimizers).Adam(
            K.optimizers.schedules.ExponentialDecay(0.02, 2, 0.8)), KK)
    data = make_data(B * 20)
    model = make_model()
    opt = make()
    step = make_step(model, opt)
    for batch in micro_batches(data, 0, 10):
        step(*batch)
    assert int(opt.window_steps) == 2
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    for batch in micro_batches(data, 10, 20):
        step(*batch)
    snapshot = state_by_variable if family == "legacy" else state
    expected = snapshot(model, opt)

    model2 = make_model(seed=1)
    opt2 = make()
    # Restore before the optimizer is built: values are applied as variables are created.
    status = tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    step2 = make_step(model2, opt2)
    for batch in micro_batches(data, 10, 20):
        step2(*batch)
    status.assert_consumed()
    got = snapshot(model2, opt2)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


def test_new_style_keras_file_resume_mid_window(tmp_path):
    model = make_model()
    model.compile(AccumOptimizer(K.optimizers.Adam(0.01), KK), "mse")
    expected, got = resume_keras_file_mid_window(K, model, make_data(B * 20), B, tmp_path / "m.keras")
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_non_finite_micro_batch_is_skipped(family):
    var = tf.Variable(np.ones((3,), np.float32))
    module = K.optimizers.legacy if family == "legacy" else K.optimizers
    opt = AccumOptimizer(module.Adam(0.1), 4)
    grads = [[1.0, 2.0, 3.0], [np.nan, 0.0, 0.0], [0.5, -1.0, 2.0], [-2.0, 0.25, 1.0]]
    for g in grads:
        opt.apply_gradients([(tf.constant(g, tf.float32), var)])
    ref_var = tf.Variable(np.ones((3,), np.float32))
    module.Adam(0.1).apply_gradients([(tf.constant(np.mean([grads[0], grads[2], grads[3]], axis=0), tf.float32), ref_var)])
    np.testing.assert_allclose(var.numpy(), ref_var.numpy(), rtol=1e-6)
    assert int(opt.iterations) == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flush_and_counters(family):
    model = make_model()
    opt = AccumOptimizer(FAMILIES[family](0.1), 3)
    step = make_step(model, opt, "function")
    history = []
    for batch in micro_batches(make_data(B * 7), 0, 7):
        step(*batch)
        history.append((int(opt.micro_steps), int(opt.iterations), int(opt.window_steps)))
    assert history == [(1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2), (6, 2, 0), (7, 2, 1)]
    opt.flush()
    assert int(opt.iterations) == 3 and int(opt.window_steps) == 0
