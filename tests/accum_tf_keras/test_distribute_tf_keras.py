"""tf_keras (new-style and legacy optimizers) under `tf.distribute`: AccumOptimizer on 2
replicas equals one device at the same global batch, and all-reduces once per update.

The checks both families share are in tests/helpers/accum_distribute_checks.py
(collected here). In-process tests use `MirroredStrategy` on 2 logical CPUs
(tests/conftest.py); one test runs 2 `MultiWorkerMirroredStrategy` worker processes
on loopback.
"""

import pytest
import tf_keras as tfk

from accum import AccumOptimizer
from benchmarks.allreduce import AllReduceCounter
from tests.helpers.accum_distribute_checks import *  # noqa: F403 (the tests, pytestmark, strategy)
from tests.helpers.accum_distribute_checks import B, assert_state_close, check_workers_match_one_process
from tests.helpers.accum_distribute_checks import STEPS as K
from tests.helpers.accum_distribute_checks import distributed_loop
from tests.helpers.tfk_reference import fresh, make_data, make_model, run, state

O, L = tfk.optimizers, tfk.optimizers.legacy


def schedule():
    return O.schedules.ExponentialDecay(0.02, 2, 0.7)


CONFIGS = {  # name: (inner optimizer, model with an embedding?)
    "adam_schedule_clipnorm": (lambda: O.Adam(schedule(), clipnorm=0.5), False),
    "sgd_momentum_embedding": (lambda: O.SGD(0.05, momentum=0.9), True),
    "legacy_adam_schedule_clipnorm": (lambda: L.Adam(schedule(), clipnorm=0.5), False),
    "legacy_sgd_momentum_embedding": (lambda: L.SGD(0.05, momentum=0.9), True),
}


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


@pytest.mark.slow
def test_two_worker_processes_match_one_process(family, tmp_path):
    """2 `MultiWorkerMirroredStrategy` workers (processes, TF_CONFIG on loopback):
    `fit` with a new-style Adam (LR schedule, clipnorm) and a custom loop with a
    legacy SGD (momentum, embedding) equal one process at batch k*B, with one
    all-reduce round per update."""
    configs = {}
    for key, config in (("adam", "adam_schedule_clipnorm"), ("sgd", "legacy_sgd_momentum_embedding")):
        make_inner, embedding = CONFIGS[config]
        configs[key] = (lambda embedding=embedding: make_model(embedding=embedding), make_inner)
    check_workers_match_one_process(family, tmp_path, configs)
