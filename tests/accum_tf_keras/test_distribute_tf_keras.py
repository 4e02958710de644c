"""tf_keras (new-style and legacy optimizers) under `tf.distribute`: AccumOptimizer on 2
replicas equals one device at the same global batch, and all-reduces once per update.

In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py); one
test runs 2 `MultiWorkerMirroredStrategy` worker processes on loopback.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as tfk

from tests.helpers import mwms
from accum import AccumOptimizer
from benchmarks.allreduce import AllReduceCounter
from tests.helpers.numerics import assert_grouped_close
from tests.helpers.tfk_reference import fresh, make_data, make_model, run, state

K, B = 4, 6  # B: global micro-batch, 3 per replica
TOL = 1e-5
O, L = tfk.optimizers, tfk.optimizers.legacy

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPU devices (see tests/conftest.py)"
)


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def assert_state_close(want, got, tol=TOL):
    assert_grouped_close(want, got, tol, [str(i) for i in range(len(want))], lambda n: "all", floor_fraction=1.0)


def schedule():
    return O.schedules.ExponentialDecay(0.02, 2, 0.7)


CONFIGS = {  # name: (inner optimizer, model with an embedding?)
    "adam_schedule_clipnorm": (lambda: O.Adam(schedule(), clipnorm=0.5), False),
    "sgd_momentum_embedding": (lambda: O.SGD(0.05, momentum=0.9), True),
    "legacy_adam_schedule_clipnorm": (lambda: L.Adam(schedule(), clipnorm=0.5), False),
    "legacy_sgd_momentum_embedding": (lambda: L.SGD(0.05, momentum=0.9), True),
}


def distributed_loop(strategy, model, optimizer, data, global_batch, counter=None, loss_scale=False):
    """A custom loop: `strategy.run` inside `tf.function`, loss averaged over the global batch."""

    def replica_step(x, ids, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model([x, ids], training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            if loss_scale:
                loss = optimizer.get_scaled_loss(loss)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if loss_scale:
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(global_batch, drop_remainder=True)
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    if counter is not None:
        with counter.counting():
            step(next(batches))  # traced here, counted at every run
    for batch in batches:
        step(batch)


@pytest.mark.parametrize("config", ["adam_schedule_clipnorm", "legacy_sgd_momentum_embedding"])
def test_mirrored_fit_matches_big_batch(config, strategy):
    """The reference applies dense gradients: the buffers are dense, and legacy
    SGD's sparse momentum update ("lazy": untouched rows keep their momentum)
    is not the dense update."""
    make_inner, embedding = CONFIGS[config]
    x, ids, y = data = make_data(K * B * 2)
    ref, ref_opt = make_model(embedding=embedding), make_inner()
    with strategy.scope():
        model = make_model(embedding=embedding)
        inner = fresh(ref_opt)
        model.compile(AccumOptimizer(inner, K), "mse")
    # tf_keras's fit also all-reduces its loss metric (scalars) at every step,
    # and MultiWorkerMirroredStrategy's dataset a [1, 1] tensor: not counted.
    counter = AllReduceCounter(functions_only=True, min_elements=2)
    with counter.counting():
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    run(ref, ref_opt, data, K * B, dense=True)
    assert int(inner.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 2
    assert int(counter.rounds.numpy()) == 2  # 8 micro-steps, k=4
    assert_state_close(state(ref, ref_opt), state(model, inner))


@pytest.mark.parametrize("legacy", [False, True], ids=["new", "legacy"])
def test_mirrored_loss_scale_optimizer_inside(legacy, strategy):
    """tf_keras's LossScaleOptimizer inside the wrapper (its recommended place), float32
    model, custom loop with get_scaled_loss/get_unscaled_gradients: exact."""
    module = L if legacy else O
    data = make_data(K * B * 2)
    ref, ref_opt = make_model(embedding=False), module.Adam(schedule())
    with strategy.scope():
        model = make_model(embedding=False)
        inner = module.Adam(schedule())
        lso = tfk.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0**10)
        optimizer = AccumOptimizer(lso, K)
        optimizer.build(model.trainable_variables)
    distributed_loop(strategy, model, optimizer, data, B, loss_scale=True)
    run(ref, ref_opt, data, K * B, dense=True)
    assert int(inner.iterations.numpy()) == 2 and float(lso.loss_scale.numpy()) == 2.0**10
    assert_state_close(state(ref, ref_opt), state(model, inner))


def test_mirrored_fit_mixed_float16(strategy):
    """`compile` under mixed_float16 wraps the AccumOptimizer in tf_keras's
    LossScaleOptimizer (outside; it "aggregates" with the wrapper, a no-op
    here); 2 replicas match one device at the same global micro-batch (float16
    compute rounds the per-replica halves differently)."""
    x, ids, y = make_data(K * B * 2)
    tfk.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref = make_model(embedding=False)
        ref_inner = O.Adam(0.01)
        ref.compile(AccumOptimizer(ref_inner, K), "mse")
        with strategy.scope():
            model = make_model(embedding=False)
            inner = O.Adam(0.01)
            model.compile(AccumOptimizer(inner, K), "mse")
        assert isinstance(model.optimizer, tfk.mixed_precision.LossScaleOptimizer)
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        ref.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    finally:
        tfk.mixed_precision.set_global_policy("float32")
    assert int(inner.iterations.numpy()) == int(ref_inner.iterations.numpy()) == 2
    assert_state_close(state(ref, ref_inner), state(model, inner), 5e-5)


def test_one_all_reduce_round_per_update(strategy):
    """Reductions executed at run time (`AllReduceCounter`): the plain optimizer
    all-reduces at each of the N micro-steps, AccumOptimizer once per update
    (legacy optimizers: counted in the fit and multi-worker tests)."""
    module = O
    data = make_data(K * B * 3)
    n_micro = 3 * K
    results = {}
    for name in ("plain", "accum"):
        counter = AllReduceCounter()
        with strategy.scope():
            model = make_model(embedding=False)
            inner = module.SGD(0.05, momentum=0.9)
            optimizer = inner if name == "plain" else AccumOptimizer(inner, K)
            optimizer.build(model.trainable_variables)
        distributed_loop(strategy, model, optimizer, data, B, counter)
        params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        results[name] = (int(counter.rounds.numpy()), int(counter.bytes.numpy()), params)
    (plain_rounds, plain_bytes, params), (rounds, nbytes, _) = results["plain"], results["accum"]
    assert plain_rounds == n_micro and plain_bytes == n_micro * params
    assert rounds == n_micro // K == 3
    # gradient + one touched flag per variable + the kept count (float32)
    assert nbytes == rounds * (params + 4 * len(model.trainable_variables) + 4)


@pytest.mark.parametrize("legacy", [False, True], ids=["new", "legacy"])
def test_momentum_mode_under_strategy_raises(legacy, strategy):
    module = L if legacy else O
    with strategy.scope():
        model = make_model(embedding=False)
        optimizer = AccumOptimizer(module.SGD(0.05, momentum=0.9), K, mode="momentum")
        with pytest.raises(NotImplementedError, match='mode="buffer"'):
            optimizer.build(model.trainable_variables)


@pytest.mark.slow
def test_two_worker_processes_match_one_process(tmp_path):
    """2 `MultiWorkerMirroredStrategy` workers (processes, TF_CONFIG on loopback):
    `fit` with a new-style Adam (LR schedule, clipnorm) and a custom loop with a
    legacy SGD (momentum, embedding) equal one process at batch k*B, with one
    all-reduce round per update."""
    workers = mwms.run_workers("tf_keras", tmp_path)
    data = make_data(K * B * 2)
    refs = {}
    for key, config in (("adam", "adam_schedule_clipnorm"), ("sgd", "legacy_sgd_momentum_embedding")):
        make_inner, embedding = CONFIGS[config]
        ref, ref_opt = make_model(embedding=embedding), make_inner()
        run(ref, ref_opt, data, K * B, dense=True)
        refs[key] = [np.array(w) for w in ref.get_weights()]
    for w in workers:
        for key, want in refs.items():
            assert_state_close(want, mwms.weights(w, key))
            assert int(w[f"{key}_iterations"]) == 2
            assert int(w[f"{key}_rounds"]) == 2  # 8 micro-steps, k=4
