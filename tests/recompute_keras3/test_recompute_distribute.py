"""recompute_grad on Keras 3 under `tf.distribute`: with recomputation on, every replica's
gradients (inputs and every weight), weights, BatchNormalization statistics and seed
states equal those without it.

In-process tests use `MirroredStrategy` on 2 logical CPUs (tests/conftest.py
configures them; this suite runs in the same process); one test runs 2
`MultiWorkerMirroredStrategy` worker processes on loopback (custom loop: Keras 3's
`fit` does not run under that strategy, keras-team/keras#20585).
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import mwms
import recompute
from tests.helpers.numerics import assert_all_close, assert_state_equal
from recompute import recompute_grad
from tests.helpers.recompute_distributed import (
    CALLS, data, keras3_model, local, run_custom_loop, state, unused_model,
)

pytestmark = pytest.mark.skipif(
    len(tf.config.list_logical_devices("CPU")) < 2,
    reason="needs 2 logical CPU devices (see tests/conftest.py)",
)
B = 8  # global batch: 4 per replica


@pytest.fixture(scope="module")
def strategy(mirrored_strategy):
    return mirrored_strategy  # one per process (tests/conftest.py)


def sgd():
    return keras.optimizers.SGD(0.1)


def distributed_batches(strategy, x, y):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    return list(strategy.experimental_distribute_dataset(dataset))


def test_mirrored_custom_loop(strategy):
    """Dropout on, BatchNormalization training; 2 steps of SGD: the second step's
    gradients and the final state, per replica."""
    batches = distributed_batches(strategy, *data(2 * B))
    runs = {
        on: run_custom_loop(strategy, keras3_model, sgd, batches, B, on) for on in (False, True)
    }
    (g0, s0, c0), (g1, s1, c1) = runs[False], runs[True]
    assert len(g0) == 2 * (1 + len(keras3_model().trainable_variables))
    assert_all_close(g0, g1)
    assert_state_equal(s0, s1)
    assert c1 == 2 * c0 > 0  # traced once per replica; recomputation traces each block again


def test_mirrored_fit(strategy):
    x, y = data(3 * B, seed=1)
    results = {}
    for on in (False, True):
        with strategy.scope():
            model = keras3_model()
            model.compile(keras.optimizers.SGD(0.1), "mse")
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
            model, unconnected = unused_model(keras)
            model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.1), "mse")
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

class CountingBlock(keras.layers.Layer):
    """Adds the batch mean to an aggregated non-trainable variable, then reads it back."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, input_shape):
        self.w = self.add_weight((input_shape[-1], input_shape[-1]), name="w")
        self.total = self.add_weight(
            (), initializer="zeros", trainable=False, aggregation=self.aggregation, name="total"
        )

    @recompute_grad
    def call(self, x):
        CALLS["n"] += 1
        self.total.assign_add(tf.reduce_mean(x))
        return tf.tanh(x @ self.w) * (1.0 + self.total)


@pytest.mark.parametrize("aggregation", ["none", "sum", "only_first_replica"])
def test_aggregated_state_variable(aggregation, strategy):
    """The recomputation records assignments in a StatelessScope; reading the variable
    back must give what the forward pass read: no gradient path to the assigned value,
    and under SUM/ONLY_FIRST_REPLICA aggregation the value combined across replicas."""

    def make():
        keras.utils.set_random_seed(0)
        inp = keras.Input((4,))
        return keras.Model(inp, CountingBlock(aggregation)(inp))

    x = np.random.RandomState(2).randn(8, 4).astype("float32")
    batches = distributed_batches(strategy, x, x[:, :1])
    runs = [run_custom_loop(strategy, make, sgd, batches * 2, B, on) for on in (False, True)]
    assert_all_close(runs[0][0], runs[1][0])
    assert_state_equal(runs[0][1], runs[1][1])
    assert runs[1][2] == 2 * runs[0][2] > 0


def test_scope_reaches_replica_threads(strategy):
    """`strategy.run` calls the replica function in threads of its own."""

    def enabled():
        return tf.constant(recompute.is_enabled())

    for on in (False, True):
        with recompute.recompute_scope(on):
            per_replica = strategy.experimental_local_results(strategy.run(enabled))
        assert [bool(v) for v in per_replica] == [on, on]
    # Two threads under opposite scopes at once: a replica cannot tell which started it.
    entered, release = threading.Event(), threading.Event()

    def other():
        with recompute.recompute_scope(False):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        entered.wait(30)
        with recompute.recompute_scope(True), pytest.raises(RuntimeError, match="cannot tell"):
            strategy.run(enabled)
    finally:
        release.set()
        thread.join()


@pytest.mark.slow
def test_two_worker_processes(tmp_path):
    """MultiWorkerMirroredStrategy, 2 processes: recomputation on equals off on each
    worker (gradients before the all-reduce, weights, statistics, seeds), and the
    workers end with the same weights."""
    workers = mwms.run_workers("keras3", tmp_path, worker=mwms.RECOMPUTE_WORKER, timeout=90)
    for w in workers:
        assert_all_close(mwms.weights(w, "grads_off"), mwms.weights(w, "grads_on"))
        assert_state_equal(mwms.weights(w, "state_off"), mwms.weights(w, "state_on"))
        assert w["calls_on"] == 2 * w["calls_off"] > 0
    # The weights are all-reduced: the workers hold the same (the moving statistics,
    # updated from each worker's own batch, need not be).
    trainable = [i for i, v in enumerate(keras3_model().weights) if v.trainable]
    ends = [mwms.weights(w, "state_on") for w in workers]
    assert_all_close([ends[0][i] for i in trainable], [ends[1][i] for i in trainable])


def test_input_gradients_wait_for_weight_gradients():
    """A block's input gradient (what releases the recomputation of the block below)
    depends on the block's weight gradients. Otherwise, with other work to run -- the
    other replica on the same host -- the executor let input gradients run ahead of
    postponed weight-gradient ops and held several blocks' recomputed activations
    (measured with `benchmarks.recompute_distribute --strategy mirrored`: 15-17 instead
    of 4.6 MiB per sample per replica)."""
    model = keras3_model()
    top_kernel = model.layers[2].d2.kernel  # the second (top) block's last Dense

    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, [x, top_kernel])

    def ancestors(tensor):
        seen, stack = set(), [tensor.op]
        while stack:
            op = stack.pop()
            if op not in seen:
                seen.add(op)
                stack.extend(t.op for t in op.inputs)
                stack.extend(op.control_inputs)
        return seen

    x = tf.zeros((4, 8))
    for on in (False, True):
        with recompute.recompute_scope(on):
            graph = tf.function(grads).get_concrete_function(x).graph
        dx, dkernel = graph.outputs[:2]
        producer = dkernel.op
        # The function's and the tape's wrappers, and (recomputed) the `+ 0` that makes
        # the gradient wait for the recomputation's weight reads (`_core.reads_since`).
        while producer.type in ("Identity", "AddV2"):
            producer = producer.inputs[0].op
        assert producer.type == "MatMul"
        assert (producer in ancestors(dx)) == on
