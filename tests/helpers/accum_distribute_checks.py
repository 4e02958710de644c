"""AccumOptimizer under `tf.distribute`, checks the same in both Keras families (TensorFlow):
2 replicas all-reduce once per update, `mode="momentum"` is refused under a strategy, and
2 `MultiWorkerMirroredStrategy` worker processes equal one process at batch k*B.

tests/accum_keras3/test_distribute.py and tests/accum_tf_keras/test_distribute_tf_keras.py
import the tests (with `pytestmark` and the fixture `strategy`) and their family's
fixtures `family` and `legacy` (tests.helpers.accum_family_checks), and add their own.
In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from benchmarks.allreduce import AllReduceCounter
from tests.helpers import mwms
from tests.helpers.numerics import assert_grouped_close

__all__ = [
    "pytestmark",
    "strategy",
    "test_one_all_reduce_round_per_update",
    "test_momentum_mode_under_strategy_raises",
    "test_mirrored_fit_mixed_float16",
]

STEPS, B = 4, 6  # k; B: global micro-batch, 3 per replica
TOL = 1e-5

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPU devices (see tests/conftest.py)"
)


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def assert_state_close(want, got, tol=TOL):
    assert_grouped_close(want, got, tol, [str(i) for i in range(len(want))], lambda n: "all", floor_fraction=1.0)


def distributed_loop(strategy, model, optimizer, data, global_batch, counter=None, loss_scale=False):
    """A custom loop: `strategy.run` inside `tf.function`, loss averaged over the global
    batch. Keras 3: scaled by `optimizer.scale_loss` (loss scaling, if any); tf_keras
    with `loss_scale`: `get_scaled_loss` and `get_unscaled_gradients`."""

    def replica_step(x, ids, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model([x, ids], training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            if loss_scale:
                loss = optimizer.get_scaled_loss(loss)
            elif hasattr(optimizer, "scale_loss"):  # Keras 3
                loss = optimizer.scale_loss(loss)
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
    with counter.counting() if counter else contextlib.nullcontext():
        step(next(batches))  # traced here, counted at every run
    for batch in batches:
        step(batch)


def test_one_all_reduce_round_per_update(family, strategy):
    """Reductions executed at run time (`AllReduceCounter`): the plain optimizer
    all-reduces at each of the N micro-steps, AccumOptimizer once per update (N/k),
    each time the whole gradient plus the kept count (`fit`, and tf_keras's legacy
    optimizers: counted in the fit and multi-worker tests)."""
    data = family.reference.make_data(STEPS * B * 3)
    n_micro = 3 * STEPS
    results = {}
    for name in ("plain", "accum"):
        counter = AllReduceCounter()
        with strategy.scope():
            model = family.reference.make_dense_model()
            inner = family.optimizers().SGD(0.05, momentum=0.9)
            optimizer = inner if name == "plain" else AccumOptimizer(inner, STEPS)
            optimizer.build(model.trainable_variables)
        distributed_loop(strategy, model, optimizer, data, B, counter)
        params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        results[name] = (int(counter.rounds.numpy()), int(counter.bytes.numpy()), params)
    (plain_rounds, plain_bytes, params), (rounds, nbytes, _) = results["plain"], results["accum"]
    assert plain_rounds == n_micro and plain_bytes == n_micro * params
    assert rounds == n_micro // STEPS == 3
    # gradient + one touched flag per variable + the kept count (float32)
    assert nbytes == rounds * (params + 4 * len(model.trainable_variables) + 4)


def test_mirrored_fit_mixed_float16(family, strategy):
    """`compile` under mixed_float16 wraps the AccumOptimizer in the family's
    LossScaleOptimizer (outside; tf_keras's "aggregates" with the wrapper, a no-op
    here); 2 replicas match one device at the same global micro-batch (float16
    compute: the per-replica halves round differently: measured 1.1e-5, allowed 5e-5)."""
    K = family.K
    x, ids, y = family.reference.make_data(STEPS * B * 2)
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref = family.reference.make_dense_model()
        ref_inner = K.optimizers.Adam(0.01)
        ref.compile(AccumOptimizer(ref_inner, STEPS), "mse")
        with strategy.scope():
            model = family.reference.make_dense_model()
            inner = K.optimizers.Adam(0.01)
            model.compile(AccumOptimizer(inner, STEPS), "mse")
        assert isinstance(model.optimizer, K.mixed_precision.LossScaleOptimizer)
        model.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        ref.fit([x, ids], y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert int(inner.iterations.numpy()) == int(ref_inner.iterations.numpy()) == 2
    assert_state_close(family.reference.state(ref, ref_inner), family.reference.state(model, inner), 5e-5)


def test_momentum_mode_under_strategy_raises(family, legacy, strategy):
    with strategy.scope():
        model = family.reference.make_dense_model()
        optimizer = AccumOptimizer(family.optimizers(legacy).SGD(0.05, momentum=0.9), STEPS, mode="momentum")
        with pytest.raises(NotImplementedError, match='mode="buffer"'):
            optimizer.build(model.trainable_variables)


def check_workers_match_one_process(family, tmp_path, configs):
    """2 `MultiWorkerMirroredStrategy` workers (tests.helpers.mwms_worker, TF_CONFIG on
    loopback) ran `configs` ({key: (make_model, make_inner)}); each equals one process at
    batch k*B, with one all-reduce round per update."""
    workers = mwms.run_workers("tf_keras" if family.legacy else "keras3", tmp_path)
    data = family.reference.make_data(STEPS * B * 2)
    refs = {}
    for key, (make_model, make_inner) in configs.items():
        ref, ref_opt = make_model(), make_inner()
        family.reference.run(ref, ref_opt, data, STEPS * B, dense=True)
        refs[key] = [np.array(w) for w in ref.get_weights()]
    for w in workers:
        for key, want in refs.items():
            assert_state_close(want, mwms.weights(w, key))
            assert int(w[f"{key}_iterations"]) == 2
            assert int(w[f"{key}_rounds"]) == 2  # 8 micro-steps, k=4
