"""Keras 3: counters, fit, callbacks, flush, warnings, non-finite micro-batches, bad input."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import accum
from accum import AccumOptimizer
from tests.helpers import k3_reference
from tests.helpers.accum_runs import fit_with_lr_callback
from tests.helpers.k3_reference import (
    concat,
    fresh,
    make_data,
    make_dense_model,
    make_model,
    make_step,
    run,
    run_batches,
    state,
    twin,
)
from tests.helpers.numerics import assert_grouped_close

K, B = 4, 3


def group(name):
    return "all"


def assert_states_close(ref, got, tol=1e-6):
    assert_grouped_close(ref, got, tol, [str(i) for i in range(len(ref))], group)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [0, -1, 2.5, 4.0, True, False, "4", None, [4]])
def test_bad_steps_per_update(bad):
    with pytest.raises(ValueError, match=r"`steps_per_update` must be an integer >= 1\. Received: steps_per_update="):
        AccumOptimizer(keras.optimizers.SGD(), bad)


@pytest.mark.parametrize("bad", ["adam", None, 3, keras.layers.Dense(2), tf.keras.__name__])
def test_not_an_optimizer(bad):
    with pytest.raises(ValueError, match=r"`optimizer` must be a Keras 3 or tf_keras optimizer"):
        AccumOptimizer(bad, 2)


def test_already_wrapped():
    wrapped = AccumOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="already an `AccumOptimizer`"):
        AccumOptimizer(wrapped, 2)
    with pytest.raises(ValueError, match="already wraps an `AccumOptimizer`"):
        AccumOptimizer(keras.optimizers.LossScaleOptimizer(AccumOptimizer(keras.optimizers.SGD(), 2)), 2)


@pytest.mark.parametrize("bad", ["Buffer", "sum", "", None, 1])
def test_unknown_mode(bad):
    with pytest.raises(ValueError, match=r"`mode` must be one of 'buffer', 'momentum', 'rescale'\. Received: mode="):
        AccumOptimizer(keras.optimizers.SGD(), 2, mode=bad)


def test_base_optimizer_arguments_rejected():
    with pytest.raises(ValueError, match="does not support `clipnorm`"):
        AccumOptimizer(keras.optimizers.SGD(), 2, clipnorm=1.0)


def test_numpy_integer_accepted():
    assert AccumOptimizer(keras.optimizers.SGD(), np.int64(3)).steps_per_update == 3


# ------------------------------------------------------- identity, config


def test_is_a_keras_optimizer_with_delegated_learning_rate():
    inner = keras.optimizers.Adam(0.01)
    opt = AccumOptimizer(inner, 4)
    assert isinstance(opt, keras.optimizers.Optimizer)
    assert isinstance(opt, AccumOptimizer)
    assert opt.inner_optimizer is inner
    opt.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5 == float(opt.learning_rate)


def test_config_round_trip():
    inner = keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5), weight_decay=0.01, clipnorm=1.0
    )
    opt = AccumOptimizer(inner, 8, name="acc")
    config = opt.get_config()
    assert config["steps_per_update"] == 8 and config["mode"] == "buffer"
    assert config["inner_optimizer"]["class_name"] == "AdamW"
    for restored in (
        AccumOptimizer.from_config(config),
        type(opt).from_config(config),
        keras.optimizers.deserialize(keras.optimizers.serialize(opt)),
    ):
        assert isinstance(restored, AccumOptimizer)
        assert restored.name == "acc" and restored.steps_per_update == 8
        assert type(restored.inner_optimizer) is keras.optimizers.AdamW
        assert restored.inner_optimizer.get_config() == inner.get_config()
    assert config == AccumOptimizer.from_config(config).get_config()


def test_counters():
    model = make_model()
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), 3)
    step = make_step(model, opt, "function")
    data = make_data(B * 7)
    before = model.get_weights()
    history = []
    for x, ids, y in [concat(data, i * B, (i + 1) * B) for i in range(7)]:
        step(x, ids, y)
        history.append((int(opt.micro_steps), int(opt.iterations), int(opt.window_steps)))
    assert history == [(1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2), (6, 2, 0), (7, 2, 1)]
    assert opt.iterations is opt.inner_optimizer.iterations
    assert not np.array_equal(before[1], model.get_weights()[1])


def test_weights_change_only_on_update_steps():
    model = make_model()
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), 3)
    step = make_step(model, opt)
    data = make_data(B * 6)
    snapshots = [model.get_weights()]
    for i in range(6):
        step(*concat(data, i * B, (i + 1) * B))
        snapshots.append(model.get_weights())
    changed = [not all(np.array_equal(a, b) for a, b in zip(s0, s1)) for s0, s1 in zip(snapshots, snapshots[1:])]
    assert changed == [False, False, True, False, False, True]


# -------------------------------------------------------------------- fit


@pytest.mark.parametrize("jit", [False, True])
def test_fit_matches_big_batch(jit):
    data = make_data(K * B * 5)
    x, ids, y = data
    model = make_dense_model()
    ref = twin(model)
    inner = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5)
    ref_opt = fresh(inner)
    model.compile(AccumOptimizer(inner, K), "mse", jit_compile=jit)
    ref.compile(ref_opt, "mse", jit_compile=jit)
    model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    ref.fit([x, ids], y, batch_size=K * B, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == int(ref_opt.iterations) == 10
    assert_states_close(state(ref, ref_opt), state(model, inner))


def test_learning_rate_callback_reaches_inner_optimizer():
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    model, ref, ref_opt = fit_with_lr_callback(k3_reference, keras, inner, K, B)
    assert float(inner.learning_rate) == pytest.approx(0.0125)
    assert_states_close(state(ref, ref_opt), state(model, inner))


# ------------------------------------------------------- flush, leftovers


def test_flush_applies_partial_window_normalized_by_its_count():
    data = make_data(B * 6)
    model = make_model()
    ref = twin(model)
    inner = keras.optimizers.Adam(0.01)
    ref_opt = fresh(inner)
    opt = AccumOptimizer(inner, K)
    run(model, opt, data, B)  # 6 micro-steps: one update, 2 pending
    assert int(opt.iterations) == 1 and int(opt.window_steps) == 2
    opt.flush()
    assert int(opt.iterations) == 2 and int(opt.window_steps) == 0
    opt.flush()  # empty window: nothing happens
    assert int(opt.iterations) == 2
    run_batches(ref, ref_opt, [concat(data, 0, K * B), concat(data, K * B, 6 * B)])
    assert_states_close(state(ref, ref_opt), state(model, inner))


def test_flush_inside_tf_function():
    model = make_model()
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), K)
    run(model, opt, make_data(B * 2), B)
    tf.function(opt.flush)()
    assert int(opt.iterations) == 1 and int(opt.window_steps) == 0


@pytest.mark.parametrize("at", ["epoch_end", "train_end"])
def test_flush_callback(at):
    steps_per_epoch, epochs = 5, 2  # 5 = 4 + 1 leftover
    data = make_data(B * steps_per_epoch)
    x, ids, y = data
    model = make_dense_model()
    ref = twin(model)
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    ref_opt = fresh(inner)
    opt = AccumOptimizer(inner, K)
    model.compile(opt, "mse")
    model.fit([x, ids], y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[opt.flush_callback(at)])
    if at == "epoch_end":
        windows = [concat(data, 0, 4 * B), concat(data, 4 * B, 5 * B)] * 2
    else:  # windows run across the epoch boundary; the last 2 micro-steps are flushed
        second = tuple(np.concatenate([a[4 * B :], a[: 3 * B]]) for a in data)
        windows = [concat(data, 0, 4 * B), second, concat(data, 3 * B, 5 * B)]
    run_batches(ref, ref_opt, windows)
    assert int(opt.iterations) == len(windows) and int(opt.window_steps) == 0
    assert_states_close(state(ref, ref_opt), state(model, inner))


def test_flush_callback_bad_argument():
    with pytest.raises(ValueError, match="`at` must be one of"):
        AccumOptimizer(keras.optimizers.SGD(), 2).flush_callback("batch_end")


def test_leftover_warns_once_and_is_carried():
    data = make_data(B * 5)
    x, ids, y = data
    model = make_dense_model()
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), K)
    model.compile(opt, "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    pending = [w for w in caught if "pending" in str(w.message)]
    assert len(pending) == 1, [str(w.message) for w in caught]
    # 10 micro-steps: 2 updates, 2 micro-steps carried (not dropped)
    assert int(opt.iterations) == 2 and int(opt.window_steps) == 2 and int(opt.window_count) == 2
    assert np.any(opt.accumulators[-1].numpy() != 0)


def test_divisible_epochs_do_not_warn():
    x, ids, y = make_data(B * 8)
    model = make_dense_model()
    model.compile(AccumOptimizer(keras.optimizers.SGD(0.1), K), "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert not [w for w in caught if "AccumOptimizer" in str(w.message)]


# ------------------------------------------------------------- batch norm


def test_batch_normalization_warning_from_fit():
    x, ids, y = make_data(B * 4)
    for batch_norm in (True, False):
        model = make_model(batch_norm=batch_norm)
        model.compile(AccumOptimizer(keras.optimizers.SGD(0.1), K), "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit([x, ids], y, batch_size=B, epochs=1, verbose=0)
        messages = [str(w.message) for w in caught if "BatchNormalization" in str(w.message)]
        assert len(messages) == int(batch_norm), messages
        if batch_norm:
            assert "LayerNormalization" in messages[0]


def test_batch_normalization_helpers():
    nested = keras.Sequential([keras.layers.Dense(2), keras.Sequential([keras.layers.BatchNormalization()])])
    assert accum.has_batch_normalization(nested)
    assert not accum.has_batch_normalization(keras.Sequential([keras.layers.LayerNormalization()]))
    with pytest.warns(UserWarning, match="BatchNormalization"):
        assert accum.warn_if_batch_normalization(nested)


# ------------------------------------------------------ non-finite, sparse


def test_non_finite_micro_batch_is_skipped():
    var = keras.Variable(np.ones((3,), np.float32))
    inner = keras.optimizers.Adam(0.1)
    opt = AccumOptimizer(inner, 4)
    grads = [np.array([1.0, 2.0, 3.0]), np.array([np.nan, 0.0, 0.0]), np.array([0.5, -1.0, 2.0]),
             np.array([-2.0, 0.25, 1.0])]
    for g in grads:
        opt.apply_gradients([(tf.constant(g, tf.float32), var)])
    assert int(opt.iterations) == 1
    ref_var = keras.Variable(np.ones((3,), np.float32))
    ref_opt = fresh(inner)
    kept = np.mean([grads[0], grads[2], grads[3]], axis=0)
    ref_opt.apply_gradients([(tf.constant(kept, tf.float32), ref_var)])
    np.testing.assert_allclose(var.numpy(), ref_var.numpy(), rtol=1e-6)
    assert np.all(np.isfinite(var.numpy()))


def test_window_with_only_non_finite_micro_batches_does_not_update():
    var = keras.Variable(np.ones((2,), np.float32))
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), 2)
    for _ in range(2):
        opt.apply_gradients([(tf.constant([np.inf, 1.0]), var)])
    assert int(opt.iterations) == 0 and int(opt.window_steps) == 0
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])


FORBIDDEN_DENSIFY = {"UnsortedSegmentSum", "ScatterNd", "SparseToDense", "TensorScatterAdd", "TensorScatterUpdate"}


def test_sparse_gradients_are_scatter_added_not_densified():
    vocab, dim = 1000, 8
    table = keras.Variable(np.zeros((vocab, dim), np.float32), name="table")
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), 4)
    opt.build([table])

    @tf.function
    def micro_step(values, indices):
        grad = tf.IndexedSlices(values, indices, tf.constant([vocab, dim], tf.int64))
        opt.apply_gradients([(grad, table)])

    values = tf.ones((5, dim))
    indices = tf.constant([3, 7, 7, 11, 999], tf.int64)
    graph_def = micro_step.get_concrete_function(values, indices).graph.as_graph_def()
    ops = {n.op for n in graph_def.node}
    for f in graph_def.library.function:
        ops |= {n.op for n in f.node_def}
    assert "ResourceScatterAdd" in ops
    assert not ops & FORBIDDEN_DENSIFY, ops & FORBIDDEN_DENSIFY
    micro_step(values, indices)
    acc = opt.accumulators[0].numpy()
    assert acc[7].tolist() == [2.0] * dim and acc[3].tolist() == [1.0] * dim and acc[0].sum() == 0


def test_public_signature_and_copy():
    import copy
    import inspect

    params = inspect.signature(AccumOptimizer).parameters
    assert list(params)[:3] == ["optimizer", "steps_per_update", "mode"]
    assert params["mode"].default == "buffer"
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), 4, mode="buffer")
    clone = copy.deepcopy(opt)
    assert type(clone) is type(opt) and clone.steps_per_update == 4
    assert AccumOptimizer.__doc__
    for name in ("flush", "flush_callback", "micro_steps", "iterations", "learning_rate", "get_config"):
        assert getattr(type(opt), name).__doc__, name
