"""recompute_grad checks under `tf.distribute` for both Keras families: with recomputation
on, every replica's gradients (inputs and every weight), weights, BatchNormalization
statistics and RNG states equal those without it. `K` (fixture, tests.helpers.families)
is `keras` or `tf_keras`; tests/recompute_keras3/test_recompute_distribute.py and
tests/recompute_tf_keras/test_recompute_distribute_tf_keras.py import the tests (with
`pytestmark` and the fixture `strategy`) and add their family's own.

In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py
configures them; each suite runs in its own process); one test runs 2
`MultiWorkerMirroredStrategy` worker processes on loopback (custom loop: Keras 3's
`fit` does not run under that strategy, keras-team/keras#20585).
"""

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers import mwms
from tests.helpers.families import is_tf_keras
from tests.helpers.numerics import assert_all_close, assert_state_equal
from tests.helpers.recompute_distributed import (
    CALLS, block_model, data, local, run_custom_loop, state, unused_model,
)

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2,
    reason="needs 2 logical CPU devices (see tests/conftest.py)",
)
B = 8  # global batch: 4 per replica


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def sgd(K):
    return lambda: K.optimizers.SGD(0.1)


def distributed_batches(strategy, x, y):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    return list(strategy.experimental_distribute_dataset(dataset))


def test_mirrored_custom_loop(K, strategy):
    """Dropout on, BatchNormalization training; 2 steps of SGD: the second step's
    gradients and the final state (tf_keras: with each Dropout's generator state), per replica."""
    batches = distributed_batches(strategy, *data(2 * B))
    model = lambda: block_model(K)  # noqa: E731
    runs = {on: run_custom_loop(strategy, model, sgd(K), batches, B, on) for on in (False, True)}
    (g0, s0, c0), (g1, s1, c1) = runs[False], runs[True]
    assert len(g0) == 2 * (1 + len(block_model(K).trainable_variables))
    if is_tf_keras(K):
        assert len(s0) == 2 * (len(block_model(K).weights) + 2)  # + the 2 generator states
    assert_all_close(g0, g1)
    assert_state_equal(s0, s1)
    assert c1 == 2 * c0 > 0  # traced once per replica; recomputation traces each block again


def test_mirrored_fit(K, strategy):
    x, y = data(3 * B, seed=1)
    results = {}
    for on in (False, True):
        with strategy.scope():
            model = block_model(K)
            model.compile(K.optimizers.SGD(0.1), "mse")
        CALLS["n"] = 0
        with recompute.recompute_scope(on):  # reaches fit's replica threads
            model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        results[on] = (state(strategy, model), CALLS["n"])
    assert_state_equal(results[False][0], results[True][0])
    assert results[True][1] > results[False][1] > 0


def test_mirrored_fit_unconnected_weights_untouched_by_weight_decay(K, strategy):
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


def counting_model(K, aggregation):
    """A block that adds the batch mean to an aggregated non-trainable variable, then reads it back."""

    class CountingBlock(K.layers.Layer):
        def __init__(self, aggregation, **kwargs):
            super().__init__(**kwargs)
            self.aggregation = aggregation

        def build(self, input_shape):
            self.w = self.add_weight(name="w", shape=(input_shape[-1], input_shape[-1]))
            self.total = self.add_weight(
                name="total", shape=(), initializer="zeros", trainable=False, aggregation=self.aggregation
            )

        @recompute_grad
        def call(self, x):
            CALLS["n"] += 1
            self.total.assign_add(tf.reduce_mean(x))
            return tf.tanh(x @ self.w) * (1.0 + self.total)

    K.utils.set_random_seed(0)
    inp = K.Input((4,))
    return K.Model(inp, CountingBlock(aggregation)(inp))


def check_aggregated_state_variable(K, strategy, aggregation):
    x = np.random.RandomState(2).randn(8, 4).astype("float32")
    batches = distributed_batches(strategy, x, x[:, :1])
    make = lambda: counting_model(K, aggregation)  # noqa: E731
    runs = [run_custom_loop(strategy, make, sgd(K), batches * 2, B, on) for on in (False, True)]
    assert_all_close(runs[0][0], runs[1][0])
    assert_state_equal(runs[0][1], runs[1][1])
    assert runs[1][2] == 2 * runs[0][2] > 0


@pytest.mark.slow
def test_mirrored_attention_policy(K, strategy):
    """`policy="attention"` under `MirroredStrategy`, dropout off (the cores' dropouts draw
    per replica): every weight's gradient, summed over the replicas, equals RECOMPUTE=0's --
    the lean LayerNorms' gamma and beta among them, whose gradients are matched to the
    variables the strategy's replica reads (`recompute.ops._layer_norm`)."""
    from tests.helpers import attention_blocks as blocks
    from tests.helpers.numerics import to_numpy

    x, mask = blocks.inputs()

    def gradients(on):
        with strategy.scope():
            K.utils.set_random_seed(0)
            cls = blocks.block_class(K, "attention")
            inputs = [K.Input((blocks.SEQ, blocks.WIDTH)), K.Input((blocks.SEQ,) * 2, dtype="bool")]
            h = inputs[0]
            for _ in range(2):
                h = cls(rate=0.0)(h, inputs[1])
            model = K.Model(inputs, K.layers.Dense(1)(K.layers.GlobalAveragePooling1D()(h)))

        def replica(x, mask):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model([x, mask], training=True) - 0.5) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        @tf.function
        def step(x, mask):
            return [strategy.reduce("SUM", g, axis=None)
                    for g in strategy.run(replica, args=(x, mask))]

        with recompute.recompute_scope(on):
            return to_numpy(step(x, mask))

    assert_all_close(gradients(False), gradients(True))


def test_two_worker_processes(K, tmp_path):
    """MultiWorkerMirroredStrategy, 2 processes: recomputation on equals off on each
    worker (gradients before the all-reduce, weights, statistics, RNG states), and the
    workers end with the same weights."""
    family = "tf_keras" if is_tf_keras(K) else "keras3"
    workers = mwms.run_workers(family, tmp_path, worker=mwms.RECOMPUTE_WORKER, timeout=90)
    for w in workers:
        assert_all_close(mwms.weights(w, "grads_off"), mwms.weights(w, "grads_on"))
        assert_state_equal(mwms.weights(w, "state_off"), mwms.weights(w, "state_on"))
        assert w["calls_on"] == 2 * w["calls_off"] > 0
    # The weights are all-reduced: the workers hold the same (the moving statistics,
    # updated from each worker's own batch, need not be).
    trainable = [i for i, v in enumerate(block_model(K).weights) if v.trainable]
    ends = [mwms.weights(w, "state_on") for w in workers]
    assert_all_close([ends[0][i] for i in trainable], [ends[1][i] for i in trainable])


# what the suites import: the tests, the module's mark and the fixture `strategy`
__all__ = [name for name in dir() if name.startswith("test_")] + ["pytestmark", "strategy"]
