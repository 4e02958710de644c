"""Keras 3 under `tf.distribute`: AccumOptimizer on 2 replicas equals one device at the same
global batch, and all-reduces once per update (not once per micro-step).

In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py); one
test runs 2 `MultiWorkerMirroredStrategy` worker processes on loopback.
Keras's built-in `gradient_accumulation_steps` crashes here in graph mode
(keras-team/keras#20582): `merge_call` inside a `tf.cond`.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import mwms
from accum import AccumOptimizer
from benchmarks.allreduce import AllReduceCounter
from tests.helpers.k3_reference import fresh, make_data, make_dense_model, make_model, run, state
from tests.helpers.numerics import assert_grouped_close

K, B = 4, 6  # B: global micro-batch, 3 per replica
TOL = 1e-5

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPU devices (see tests/conftest.py)"
)


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def assert_state_close(want, got, tol=TOL):
    assert_grouped_close(want, got, tol, [str(i) for i in range(len(want))], lambda n: "all", floor_fraction=1.0)


def adam_schedule_clipnorm():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7), clipnorm=0.5)


def sgd_momentum():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def distributed_loop(strategy, model, optimizer, data, global_batch, counter=None):
    """A custom loop: `strategy.run` inside `tf.function`, loss averaged over the global
    batch (and scaled by `optimizer.scale_loss`: loss scaling, if any)."""

    def replica_step(x, ids, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model([x, ids], training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            loss = optimizer.scale_loss(loss)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(global_batch, drop_remainder=True)
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    with counter.counting() if counter else contextlib.nullcontext():
        step(next(batches))  # traced here, counted at every run
    for batch in batches:
        step(batch)


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


def test_mirrored_fit_mixed_float16(strategy):
    """`compile` under mixed_float16 wraps the AccumOptimizer in a LossScaleOptimizer;
    2 replicas match one device at the same global micro-batch (float16 compute:
    the per-replica halves round differently: measured 1.1e-5, allowed 5e-5)."""
    x, ids, y = make_data(K * B * 2)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        ref = make_dense_model()
        ref_opt = AccumOptimizer(keras.optimizers.Adam(0.01), K)
        ref.compile(ref_opt, "mse")
        with strategy.scope():
            model = make_dense_model()
            inner = keras.optimizers.Adam(0.01)
            model.compile(AccumOptimizer(inner, K), "mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        ref.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert int(inner.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 2
    assert_state_close(state(ref, ref_opt.inner_optimizer), state(model, inner), 5e-5)


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


def test_one_all_reduce_round_per_update(strategy):
    """Counts the reductions executed at run time (`AllReduceCounter`): the plain
    optimizer all-reduces at each of the N micro-steps, AccumOptimizer once per
    update (N/k), each time the whole gradient plus the kept count. (`fit`:
    counted in the fit tests.)"""
    data = make_data(K * B * 3)
    n_micro = 3 * K
    results = {}
    for name in ("plain", "accum"):
        counter = AllReduceCounter()
        with strategy.scope():
            model = make_dense_model()
            optimizer = sgd_momentum() if name == "plain" else AccumOptimizer(sgd_momentum(), K)
            optimizer.build(model.trainable_variables)
        distributed_loop(strategy, model, optimizer, data, B, counter)
        params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        results[name] = (int(counter.rounds.numpy()), int(counter.bytes.numpy()), params)
    (plain_rounds, plain_bytes, params), (rounds, nbytes, _) = results["plain"], results["accum"]
    assert plain_rounds == n_micro and plain_bytes == n_micro * params
    assert rounds == n_micro // K == 3
    # gradient + one touched flag per variable + the kept count (float32)
    assert nbytes == rounds * (params + 4 * len(model.trainable_variables) + 4)


def test_momentum_mode_under_strategy_raises(strategy):
    with strategy.scope():
        model = make_dense_model()
        optimizer = AccumOptimizer(sgd_momentum(), K, mode="momentum")
        with pytest.raises(NotImplementedError, match='mode="buffer"'):
            optimizer.build(model.trainable_variables)


@pytest.mark.slow
def test_two_worker_processes_match_one_process(tmp_path):
    """2 `MultiWorkerMirroredStrategy` workers (processes, TF_CONFIG on loopback),
    custom loops (Keras 3's `fit` does not run under this strategy for any
    optimizer, keras-team/keras#20585): equal to one process at batch k*B, one
    all-reduce round per update."""
    workers = mwms.run_workers("keras3", tmp_path)
    data = make_data(K * B * 2)
    refs = {}
    for key, make_model_, make_inner in (("adam", make_dense_model, adam_schedule_clipnorm),
                                         ("sgd", make_model, sgd_momentum)):
        ref, ref_opt = make_model_(), make_inner()
        run(ref, ref_opt, data, K * B, dense=True)
        refs[key] = [np.array(w) for w in ref.get_weights()]
    for w in workers:
        for key, want in refs.items():
            assert_state_close(want, mwms.weights(w, key))
            assert int(w[f"{key}_iterations"]) == 2
            assert int(w[f"{key}_rounds"]) == 2  # 8 micro-steps, k=4
