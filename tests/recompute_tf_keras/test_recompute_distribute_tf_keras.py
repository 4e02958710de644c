"""recompute_grad on tf_keras under `tf.distribute`: with recomputation on, every replica's
gradients (inputs and every weight), weights, BatchNormalization statistics and RNG
states equal those without it (replayable RNG: `enable_tf_random_generator()`).

In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py
configures them; this suite runs in the same process); one test runs 2
`MultiWorkerMirroredStrategy` worker processes on loopback.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

from tests.helpers import mwms
import recompute
from tests.helpers.numerics import assert_all_close, assert_state_equal
from recompute import _core, recompute_grad
from tests.helpers.recompute_distributed import (
    CALLS, data, local, run_custom_loop, state, tf_keras_model, unused_model,
)

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2,
    reason="needs 2 logical CPU devices (see tests/conftest.py)",
)
B = 8  # global batch: 4 per replica


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG (tf.random.Generator), as the rest of this suite uses."""
    K.backend.experimental.enable_tf_random_generator()
    yield
    K.backend.experimental.enable_tf_random_generator()


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def sgd():
    return K.optimizers.SGD(0.1)


def distributed_batches(strategy, x, y):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    return list(strategy.experimental_distribute_dataset(dataset))


def test_mirrored_custom_loop(strategy):
    """Dropout on, BatchNormalization training; 2 steps of SGD: the second step's
    gradients and the final state (with each Dropout's generator state), per replica."""
    batches = distributed_batches(strategy, *data(2 * B))
    runs = {
        on: run_custom_loop(strategy, tf_keras_model, sgd, batches, B, on) for on in (False, True)
    }
    (g0, s0, c0), (g1, s1, c1) = runs[False], runs[True]
    assert len(g0) == 2 * (1 + len(tf_keras_model().trainable_variables))
    assert len(s0) == 2 * (len(tf_keras_model().weights) + 2)  # + the 2 generator states
    assert_all_close(g0, g1)
    assert_state_equal(s0, s1)
    assert c1 == 2 * c0 > 0  # traced once per replica; recomputation traces each block again


def test_mirrored_fit(strategy):
    x, y = data(3 * B, seed=1)
    results = {}
    for on in (False, True):
        with strategy.scope():
            model = tf_keras_model()
            model.compile(K.optimizers.SGD(0.1), "mse")
        CALLS["n"] = 0
        with recompute.recompute_scope(on):  # reaches fit's replica threads
            model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        results[on] = (state(strategy, model), CALLS["n"])
    assert_state_equal(results[False][0], results[True][0])
    assert results[True][1] > results[False][1] > 0



def test_mirrored_fit_unconnected_weights_untouched_by_weight_decay(strategy):
    """Weights the output does not depend on get no gradient (None, not zero) per
    replica, so AdamW's weight decay leaves them alone, as without recomputation."""
    x, y = data(3 * B, seed=1)
    results = {}
    for on in (False, True):
        with strategy.scope():
            model, unconnected = unused_model(K)
            model.compile(K.optimizers.AdamW(0.01, weight_decay=0.1), "mse")
        start = [np.asarray(v) for v in unconnected]
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        for v, v0 in zip(unconnected, start):
            for a in local(strategy, v):
                np.testing.assert_array_equal(a, v0)
        results[on] = (state(strategy, model), CALLS["n"])
    assert_state_equal(results[False][0], results[True][0])
    assert results[True][1] > results[False][1] > 0

class CountingBlock(K.layers.Layer):
    """Adds the batch mean to an aggregated non-trainable variable, then reads it back."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, input_shape):
        self.w = self.add_weight("w", (input_shape[-1], input_shape[-1]))
        self.total = self.add_weight(
            "total", (), initializer="zeros", trainable=False, aggregation=self.aggregation
        )

    @recompute_grad
    def call(self, x):
        CALLS["n"] += 1
        self.total.assign_add(tf.reduce_mean(x))
        return tf.tanh(x @ self.w) * (1.0 + self.total)


AGGREGATIONS = {"sum": tf.VariableAggregation.SUM, "first": tf.VariableAggregation.ONLY_FIRST_REPLICA}


@pytest.mark.parametrize("aggregation", AGGREGATIONS.values(), ids=AGGREGATIONS.keys())
def test_aggregated_state_variable(aggregation, strategy):
    """The replay writes this replica's copy of the state (an aggregated assignment
    would all-reduce it: with SUM, the restored value came back doubled)."""

    def make():
        K.utils.set_random_seed(0)
        inp = K.Input((4,))
        return K.Model(inp, CountingBlock(aggregation)(inp))

    x = np.random.RandomState(2).randn(8, 4).astype("float32")
    batches = distributed_batches(strategy, x, x[:, :1])
    runs = [run_custom_loop(strategy, make, sgd, batches * 2, B, on) for on in (False, True)]
    assert_all_close(runs[0][0], runs[1][0])
    assert_state_equal(runs[0][1], runs[1][1])
    assert runs[1][2] == 2 * runs[0][2] > 0


@pytest.mark.slow
def test_two_worker_processes(tmp_path):
    """MultiWorkerMirroredStrategy, 2 processes: recomputation on equals off on each
    worker (gradients before the all-reduce, weights, statistics, RNG states), and the
    workers end with the same weights."""
    workers = mwms.run_workers("tf_keras", tmp_path, worker=mwms.RECOMPUTE_WORKER, timeout=90)
    for w in workers:
        assert_all_close(mwms.weights(w, "grads_off"), mwms.weights(w, "grads_on"))
        assert_state_equal(mwms.weights(w, "state_off"), mwms.weights(w, "state_on"))
        assert w["calls_on"] == 2 * w["calls_off"] > 0
    trainable = [i for i, v in enumerate(tf_keras_model().weights) if v.trainable]
    ends = [mwms.weights(w, "state_on") for w in workers]
    assert_all_close([ends[0][i] for i in trainable], [ends[1][i] for i in trainable])


class MaskBlock(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = K.layers.Dropout(0.5)

    @recompute_grad
    def call(self, x, training=None):
        CALLS["n"] += 1
        return self.drop(x, training=training)


def test_mirrored_legacy_rng_recomputes_the_forward_masks(strategy, monkeypatch):
    """tf_keras's default legacy RNG: the masks differ from a run without recomputation
    (see the warning), but each replica's recomputation uses its forward pass's masks:
    the gradient is nonzero exactly where the output is."""
    K.backend.experimental.disable_tf_random_generator()
    monkeypatch.setattr(_core, "_legacy_rng_warned", False)  # the warning is given once
    with strategy.scope():
        block = MaskBlock()
    x = np.ones((8, 64), "float32")

    @tf.function
    def step(x):
        def replica(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = block(x, training=True)
                loss = tf.reduce_sum(y)
            return y, tape.gradient(loss, x)

        return strategy.run(replica, args=(x,))

    (x_dist,) = distributed_batches(strategy, x, x[:, :1])[0][:1]
    CALLS["n"] = 0
    with recompute.recompute_scope(True), pytest.warns(UserWarning, match="legacy"):
        y, g = step(x_dist)
    assert CALLS["n"] == 4  # 2 replicas, each: forward + recomputation
    for y_r, g_r in zip(strategy.experimental_local_results(y), strategy.experimental_local_results(g)):
        kept = np.asarray(y_r) != 0
        assert 0 < kept.mean() < 1
        np.testing.assert_array_equal(np.asarray(g_r) != 0, kept)
