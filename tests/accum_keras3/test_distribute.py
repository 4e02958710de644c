"""Keras 3 under `tf.distribute`: AccumOptimizer on 2 replicas equals one device at the same
global batch, and all-reduces once per update (not once per micro-step).

The checks both families share are in tests/helpers/accum_distribute_checks.py
(collected here). In-process tests use `MirroredStrategy` on 2 logical CPUs
(tests/conftest.py); one test runs 2 `MultiWorkerMirroredStrategy` worker processes
on loopback. Keras's built-in `gradient_accumulation_steps` crashes here in graph mode
(keras-team/keras#20582): `merge_call` inside a `tf.cond`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from benchmarks.allreduce import AllReduceCounter
from tests.helpers.accum_distribute_checks import *  # noqa: F403 (the tests, pytestmark, strategy)
from tests.helpers.accum_distribute_checks import B, assert_state_close, check_workers_match_one_process
from tests.helpers.accum_distribute_checks import STEPS as K
from tests.helpers.accum_distribute_checks import distributed_loop
from tests.helpers.accum_family_checks import keras3_family, new_style_only  # noqa: F401 (fixtures)
from tests.helpers.k3_reference import fresh, make_data, make_dense_model, make_model, run, state


def adam_schedule_clipnorm():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5)


def sgd_momentum():
    return keras.optimizers.SGD(0.05, momentum=0.9)


@pytest.mark.parametrize(
    "make_model_, make_inner",
    [(make_dense_model, adam_schedule_clipnorm), (make_model, sgd_momentum)],
    ids=["adam_schedule_clipnorm_dense", "sgd_momentum_embedding"],
)
def test_mirrored_fit_matches_big_batch(make_model_, make_inner, strategy):
    """The reference is the inner optimizer at batch k*b on one device (Keras's
    own optimizers clip per replica under a strategy, which is not batch k*b)."""
    x, ids, y = make_data(K * B * 3)
    ref = make_model_()
    ref_opt = make_inner()
    ref.compile(ref_opt, "mse")
    with strategy.scope():
        model = make_model_()
        model.set_weights(ref.get_weights())
        inner = fresh(ref_opt)
        model.compile(AccumOptimizer(inner, K), "mse")
    counter = AllReduceCounter(functions_only=True)  # fit also reduces its first batch eagerly
    with counter.counting():
        model.fit([x, ids], y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    ref.fit([x, ids], y, batch_size=K * B, epochs=2, shuffle=False, verbose=0)
    assert int(inner.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 6
    assert int(counter.rounds.numpy()) == 6  # 24 micro-steps, k=4
    assert_state_close(state(ref, ref_opt), state(model, inner), 1e-6)


def test_mirrored_custom_loop_matches_big_batch(strategy):
    """(SGD with an embedding in a custom loop: the multi-worker test.)"""
    data = make_data(K * B * 2)
    ref, ref_opt = make_dense_model(), adam_schedule_clipnorm()
    with strategy.scope():
        model = make_dense_model()
        model.set_weights(ref.get_weights())
        inner = fresh(ref_opt)
        optimizer = AccumOptimizer(inner, K)
        optimizer.build(model.trainable_variables)
    distributed_loop(strategy, model, optimizer, data, B)
    run(ref, ref_opt, data, K * B, dense=True)
    assert int(inner.iterations.numpy()) == 2 and int(optimizer.micro_steps.numpy()) == 2 * K
    assert_state_close(state(ref, ref_opt), state(model, inner))


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_mirrored_fit_with_loss_scaling(where, strategy):
    """Keras 3's LossScaleOptimizer outside (what `compile` builds under
    mixed_float16) or inside the wrapper, float32 model: exact, LR schedule too."""
    x, ids, y = make_data(K * B * 2)
    ref, ref_opt = make_dense_model(), adam_schedule_clipnorm()
    ref.compile(ref_opt, "mse")
    LSO = keras.optimizers.LossScaleOptimizer
    with strategy.scope():
        model = make_dense_model()
        inner = fresh(ref_opt)
        if where == "outside":
            optimizer = LSO(AccumOptimizer(inner, K), initial_scale=2.0**10)
        else:
            optimizer = AccumOptimizer(LSO(inner, initial_scale=2.0**10), K)
        model.compile(optimizer, "mse")
    model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref.fit([x, ids], y, batch_size=K * B, epochs=1, shuffle=False, verbose=0)
    assert int(inner.iterations.numpy()) == 2
    assert_state_close(state(ref, ref_opt), state(model, inner))


def test_mirrored_flush_callback(strategy):
    """A partial window at the end of `fit` is applied by `flush_callback` (a collective)."""
    n_micro = 2 * K + 2
    x, ids, y = make_data(B * n_micro)
    ref, ref_opt = make_dense_model(), sgd_momentum()
    with strategy.scope():
        model = make_dense_model()
        inner = fresh(ref_opt)
        optimizer = AccumOptimizer(inner, K)
        model.compile(optimizer, "mse")
    model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[optimizer.flush_callback("train_end")])
    from tests.helpers.k3_reference import run_batches

    run_batches(ref, ref_opt, [tuple(a[s:e] for a in (x, ids, y))
                               for s, e in ((0, K * B), (K * B, 2 * K * B), (2 * K * B, n_micro * B))])
    assert int(inner.iterations.numpy()) == 3 and int(optimizer.window_steps.numpy()) == 0
    assert_state_close(state(ref, ref_opt), state(model, inner))


def test_non_finite_micro_batch_on_one_replica(strategy):
    """A micro-batch whose gradients are not finite on one replica only is dropped
    there; the window's mean divides by the (replica, micro-batch) pairs kept,
    and an inner LossScaleOptimizer halves its scale once, at the window's end."""
    x, ids, y = make_data(K * B)
    y = y.copy()
    y[B + B // 2] = np.nan  # micro-batch 1, replica 1's half
    with strategy.scope():
        model = make_dense_model()
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**4)
        optimizer = AccumOptimizer(lso, K)
        optimizer.build(model.trainable_variables)
    ref = make_dense_model()
    distributed_loop(strategy, model, optimizer, (x, ids, y), B)
    assert float(lso.dynamic_scale.numpy()) == 2.0**3 and int(lso.iterations.numpy()) == 1
    # One device: the mean over the 7 kept half-batches of their gradients, each
    # a sum over 3 samples / B (the global batch), times 2 replicas.
    kept = np.ones(K * B, bool)
    kept[B + B // 2:2 * B] = False
    with tf.GradientTape() as tape:
        per_example = tf.reduce_mean(tf.square(ref([x[kept], ids[kept]]) - y[kept]), axis=-1)
        loss = tf.reduce_sum(per_example) / B * 2 / 7
    grads = tape.gradient(loss, ref.trainable_variables)
    keras.optimizers.SGD(0.1).apply(grads, ref.trainable_variables)
    assert_state_close([np.array(w) for w in ref.get_weights()], model.get_weights())


@pytest.mark.slow
def test_two_worker_processes_match_one_process(family, tmp_path):
    """2 `MultiWorkerMirroredStrategy` workers (processes, TF_CONFIG on loopback),
    custom loops (Keras 3's `fit` does not run under this strategy for any
    optimizer, keras-team/keras#20585): equal to one process at batch k*B, one
    all-reduce round per update."""
    check_workers_match_one_process(
        family, tmp_path, {"adam": (make_dense_model, adam_schedule_clipnorm), "sgd": (make_model, sgd_momentum)}
    )
