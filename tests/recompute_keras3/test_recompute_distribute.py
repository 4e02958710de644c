"""recompute_grad on Keras 3 under `tf.distribute`: the checks of
tests/helpers/recompute_distribute_checks.py (every replica's gradients, weights,
BatchNormalization statistics and seed states equal those without recomputation),
and Keras 3's own: the scope in replica threads, the order of the gradients.
"""

import threading

import keras
import pytest
import tensorflow as tf

import recompute
from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.recompute_distribute_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.recompute_distribute_checks import check_aggregated_state_variable
from tests.helpers.recompute_distributed import block_model


@pytest.mark.parametrize("aggregation", ["none", "sum", "only_first_replica"])
def test_aggregated_state_variable(aggregation, strategy):
    """The recomputation records assignments in a StatelessScope; reading the variable
    back must give what the forward pass read: no gradient path to the assigned value,
    and under SUM/ONLY_FIRST_REPLICA aggregation the value combined across replicas."""
    check_aggregated_state_variable(keras, strategy, aggregation)


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


def test_input_gradients_wait_for_weight_gradients():
    """A block's input gradient (what releases the recomputation of the block below)
    depends on the block's weight gradients. Otherwise, with other work to run -- the
    other replica on the same host -- the executor let input gradients run ahead of
    postponed weight-gradient ops and held several blocks' recomputed activations
    (measured with `benchmarks.recompute_distribute --strategy mirrored`: 15-17 instead
    of 4.6 MiB per sample per replica)."""
    model = block_model(keras)
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
        # The function's and the tape's wrappers, and (recomputed) the gate that makes the
        # gradient wait for the recomputation's weight reads (`_core.reads_since`): a whole
        # `Slice` where TensorFlow sees no GPU, else `+ 0` (`_core.after`).
        while producer.type in ("Identity", "AddV2", "Slice"):
            producer = producer.inputs[0].op
        assert producer.type == "MatMul"
        assert (producer in ancestors(dx)) == on
