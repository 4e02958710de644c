"""Keras 3: buffers and counters are saved; resuming mid-window is bit-exact; state by name."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from tests.helpers.accum_runs import resume_keras_file_mid_window
from tests.helpers.k3_reference import concat, make_data, make_model, make_step, state, twin

K, B = 4, 3


def micro_batches(data, start, stop):
    return [concat(data, i * B, (i + 1) * B) for i in range(start, stop)]


def assert_bit_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def new_optimizer(k=K):
    return AccumOptimizer(keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.8)), k)


def test_checkpoint_resume_mid_window_is_bit_exact(tmp_path):
    data = make_data(B * 20)
    model = make_model()
    opt = new_optimizer()
    step = make_step(model, opt)
    start_weights = model.get_weights()
    for batch in micro_batches(data, 0, 10):  # 2 windows + 2 micro-steps pending
        step(*batch)
    assert int(opt.window_steps) == 2
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    for batch in micro_batches(data, 10, 20):
        step(*batch)
    expected = state(model, opt)

    model2 = make_model(seed=1)
    model2.set_weights([np.zeros_like(w) for w in start_weights])
    opt2 = new_optimizer()
    opt2.build(model2.trainable_variables)
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
    assert int(opt2.window_steps) == 2 and int(opt2.micro_steps) == 10 and int(opt2.iterations) == 2
    step2 = make_step(model2, opt2)
    for batch in micro_batches(data, 10, 20):
        step2(*batch)
    assert_bit_equal(expected, state(model2, opt2))


def test_keras_file_resume_mid_window_is_bit_exact(tmp_path):
    model = make_model()
    model.compile(new_optimizer(), "mse")
    expected, got = resume_keras_file_mid_window(keras, model, make_data(B * 20), B, tmp_path / "m.keras", 2)
    assert_bit_equal(expected, got)


def test_changed_k_keeps_inner_slots_keras_file(tmp_path):
    data = make_data(B * 10)
    model = make_model()
    model.compile(new_optimizer(4), "mse")
    for bx, bi, by in micro_batches(data, 0, 10):
        model.train_on_batch([bx, bi], by)
    model.save(tmp_path / "m.keras")

    other = twin(model)
    other.set_weights([np.zeros_like(w) for w in model.get_weights()])
    opt8 = new_optimizer(8)
    other.compile(opt8, "mse")
    opt8.build(other.trainable_variables)
    other.load_weights(tmp_path / "m.keras")
    inner, inner8 = model.optimizer.inner_optimizer, opt8.inner_optimizer
    assert int(inner8.iterations) == 2
    assert_bit_equal([v.numpy() for v in inner.variables], [v.numpy() for v in inner8.variables])
    assert any(np.any(v.numpy() != 0) for v in inner8.variables[2:])
    assert int(opt8.window_steps) == 2  # the pending micro-steps join the k=8 window
    assert_bit_equal([a.numpy() for a in model.optimizer.accumulators], [a.numpy() for a in opt8.accumulators])


def test_changed_k_keeps_inner_slots_checkpoint(tmp_path):
    data = make_data(B * 8)
    model = make_model()
    opt = new_optimizer(4)
    step = make_step(model, opt)
    for batch in micro_batches(data, 0, 8):
        step(*batch)
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
    opt2 = new_optimizer(2)
    opt2.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=opt2).read(path).assert_consumed()
    assert_bit_equal([v.numpy() for v in opt.inner_optimizer.variables],
                     [v.numpy() for v in opt2.inner_optimizer.variables])


def test_keras_file_round_trip_before_training(tmp_path):
    model = make_model()
    model.compile(new_optimizer(), "mse")
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.steps_per_update == K
    assert loaded.optimizer.get_config() == model.optimizer.get_config()


def dense_model(frozen=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.layers[0].trainable = not frozen
    return model


def train_dense(model, steps):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        model.train_on_batch(rng.normal(size=(3, 5)).astype("float32"), rng.normal(size=(3, 2)).astype("float32"))


def test_buffers_not_matching_the_variables_raise(tmp_path):
    model = dense_model()
    model.compile(new_optimizer(), "mse")
    train_dense(model, 3)
    model.save_weights(tmp_path / "m.weights.h5")
    other = dense_model(frozen=True)  # 2 trainable variables instead of 4
    other.compile(new_optimizer(), "mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match=r"Expected: 2 buffer\(s\).* shapes \[\(4, 2\), \(2,\)\]\. Received: 4 buffer\(s\)"):
        other.load_weights(tmp_path / "m.weights.h5")


def test_pending_buffers_into_momentum_mode_raise_empty_window_loads(tmp_path):
    def sgd(mode="buffer"):
        return AccumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), K, mode=mode)

    model = dense_model()
    model.compile(sgd(), "mse")
    train_dense(model, K + 1)  # one micro-step pending
    model.save_weights(tmp_path / "pending.weights.h5")
    train_dense(model, K - 1)  # window complete: buffers zero
    model.save_weights(tmp_path / "empty.weights.h5")
    other = dense_model()
    other.compile(sgd("momentum"), "mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match=r"Expected: 0 buffer\(s\).*mode='momentum'.*Received: 4"):
        other.load_weights(tmp_path / "pending.weights.h5")
    other.load_weights(tmp_path / "empty.weights.h5")
    assert int(other.optimizer.iterations) == 2 and int(other.optimizer.window_steps) == 0
    assert int(other.optimizer.micro_steps) == 2 * K


def test_window_into_unbuilt_optimizer_warns(tmp_path):
    model = dense_model()
    model.compile(new_optimizer(), "mse")
    train_dense(model, 3)
    model.save_weights(tmp_path / "m.weights.h5")
    other = dense_model()
    other.compile(new_optimizer(), "mse")
    with pytest.warns(UserWarning, match=r"3 .*not built yet.*optimizer.build\(model.trainable_variables\)"):
        other.load_weights(tmp_path / "m.weights.h5")
