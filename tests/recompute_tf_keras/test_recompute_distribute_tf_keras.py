"""recompute_grad on tf_keras under `tf.distribute`: the checks of
tests/helpers/recompute_distribute_checks.py (every replica's gradients, weights,
BatchNormalization statistics and RNG states equal those without recomputation;
replayable RNG: `enable_tf_random_generator()`), and tf_keras's own: the legacy RNG.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

import recompute
from recompute.engine import _core
from recompute import recompute_grad
from tests.helpers.families import tf_keras  # noqa: F401 (the fixture K)
from tests.helpers.recompute_distribute_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.recompute_distribute_checks import check_aggregated_state_variable, distributed_batches
from tests.helpers.recompute_distributed import CALLS


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG (tf.random.Generator), as the rest of this suite uses."""
    K.backend.experimental.enable_tf_random_generator()
    yield
    K.backend.experimental.enable_tf_random_generator()


AGGREGATIONS = {"sum": tf.VariableAggregation.SUM, "first": tf.VariableAggregation.ONLY_FIRST_REPLICA}


@pytest.mark.parametrize("aggregation", AGGREGATIONS.values(), ids=AGGREGATIONS.keys())
def test_aggregated_state_variable(aggregation, strategy):
    """The replay writes this replica's copy of the state (an aggregated assignment
    would all-reduce it: with SUM, the restored value came back doubled)."""
    check_aggregated_state_variable(K, strategy, aggregation)


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


def test_mirrored_declared_block_by_cuts(strategy, monkeypatch):
    """A block declared per-sample (`recompute.policies._blocks`, as bert4keras's blocks are)
    under `MirroredStrategy`, replayable RNG, dropout on: each replica runs its 4 samples in
    cuts of 2, its dropouts drawing what the replica's generator draws for its whole batch
    (the key mixed with the replica's id, `recompute.adapters._tf.generator_key_counter`).
    Two steps: the gradients summed over the replicas equal RECOMPUTE=0's."""
    from recompute.adapters import _tf_keras
    from recompute.policies import _blocks
    from tests.helpers.numerics import assert_all_close, to_numpy
    from tests.helpers.recompute_runs import count_cut_recomputations

    with strategy.scope():
        K.utils.set_random_seed(0)
        x_in = K.Input((6, 8))
        h = K.layers.Dropout(0.3)(K.layers.Dense(16, activation="relu")(x_in))
        block = K.Model(x_in, K.layers.LayerNormalization()(K.layers.Dense(8)(h) + x_in))
        block.call = recompute_grad(block.call)
        _blocks.declare_per_sample(block)
    x = tf.constant(np.random.RandomState(0).randn(8, 6, 8).astype("float32"))
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    strategy.run(lambda x: block(x, training=True), args=(batch,))  # the generators made
    variables = list(block.weights) + list(_tf_keras.state_variables(block))
    start = [v.numpy() for v in variables]

    def replica(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(block(x, training=True) ** 2)
        return tape.gradient(loss, block.trainable_weights)

    @tf.function
    def step(x):
        return [strategy.reduce("SUM", g, axis=None) for g in strategy.run(replica, args=(x,))]

    cutting = count_cut_recomputations(monkeypatch)
    results = []
    for on in (False, True):
        for v, value in zip(variables, start):
            v.assign(value)
        with recompute.recompute_scope(on), recompute.batch_cut(2):
            run = tf.function(step.python_function)
            results.append([to_numpy(run(batch)) for _ in range(2)])
    assert cutting["n"] == 2  # once per replica, traced once
    for s in range(2):
        assert_all_close(results[0][s], results[1][s])
