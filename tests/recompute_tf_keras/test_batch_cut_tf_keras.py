"""tf_keras: a block recomputed under "full" in cuts of its batch (`recompute.batch_cut`),
for layers declared to compute each sample alone (`recompute.policies._blocks`; bert4keras's
blocks: tests/bert4keras/test_bert4keras_block_cuts.py). Each cut's random draws are the whole
batch's (`recompute.adapters._tf_keras.windowed_draws`); where one cannot be, the call runs
whole."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import recompute
from recompute import recompute_grad
from recompute.adapters import _tf, _tf_keras
from recompute.engine import _running
from recompute.policies import _blocks
from tests.helpers.numerics import assert_all_close, to_numpy
from tests.helpers.recompute_runs import count_cut_recomputations


def _block(noise_shape=None, declared=True, seq=6):
    """A functional block of `Dense`, `Dropout` and `LayerNormalization` layers, its call
    recomputed, declared per-sample unless not `declared`; `seq`: its input's length (None:
    any)."""
    x = tf_keras.Input((seq, 8))
    h = tf_keras.layers.Dense(16, activation="relu")(x)
    h = tf_keras.layers.Dropout(0.3, noise_shape=noise_shape)(h)
    y = tf_keras.layers.LayerNormalization()(tf_keras.layers.Dense(8)(h) + x)
    block = tf_keras.Model(x, y)
    block.call = recompute_grad(block.call)
    if declared:
        _blocks.declare_per_sample(block)
    return block


def _run(block, on, cut, signature=None, jit=False):
    """Two steps' loss and gradients of `block` on 5 samples. `signature`: the step's input
    shape when traced."""
    x = tf.constant(np.random.RandomState(0).randn(5, 6, 8).astype("float32"))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(block(x, training=True) ** 2)
        return [loss] + tape.gradient(loss, block.trainable_weights)

    step = tf.function(step, jit_compile=jit, input_signature=None if signature is None
                       else [tf.TensorSpec(signature, tf.float32)])
    with recompute.recompute_scope(on), recompute.batch_cut(cut):
        return [to_numpy(step(x)) for _ in range(2)]


@pytest.fixture
def replayable_rng():
    tf_keras.backend.experimental.enable_tf_random_generator()
    yield
    tf_keras.backend.experimental.disable_tf_random_generator()


def _variables(block):
    """The block's weights and its random generators' states."""
    return list(block.weights) + list(_tf_keras.state_variables(block))


@pytest.mark.parametrize("noise_shape, declared, cuts", [
    (None, True, 1), ((None, 1, 16), True, 0), (None, False, 0)],
    ids=["declared", "noise-shape", "undeclared"])
def test_declared_block_runs_by_cuts_where_every_draw_is_the_batchs(
        replayable_rng, monkeypatch, noise_shape, declared, cuts):
    """A declared block with a plain dropout runs by cuts; one whose dropout has a noise
    shape (a draw that is not the batch's for the cut's samples) runs whole, as does an
    undeclared one. Every run equals RECOMPUTE=0's, two steps, the dropout on."""
    tf_keras.utils.set_random_seed(0)
    block = _block(noise_shape, declared)
    block(tf.zeros([1, 6, 8]), training=True)  # the generator made
    start = [v.numpy() for v in _variables(block)]
    cutting = count_cut_recomputations(monkeypatch)
    results = []
    for on in (False, True):
        for v, value in zip(_variables(block), start):  # the generator's state included
            v.assign(value)
        results.append(_run(block, on, 2))
    assert cutting["n"] == cuts
    for step in range(2):
        assert_all_close(results[0][step], results[1][step])


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_generator_window_is_the_whole_draw_cut(dtype):
    """A `tf.random.Generator`'s numbers for a window of the batch (`_tf_keras`, through
    `_tf.uniform_window`) are the whole draw's for those samples, and the state advances as
    the whole draw advances it."""
    from tf_keras.src import backend

    shape = [5, 3, 7]
    whole_gen = backend.RandomGenerator(seed=3, rng_type="stateful")
    cut_gen = backend.RandomGenerator(seed=3, rng_type="stateful")
    whole_gen._maybe_init(), cut_gen._maybe_init()
    whole = whole_gen._generator.uniform(shape, dtype=dtype).numpy()
    start = cut_gen._generator.state.read_value()
    for begin, size in [(0, 2), (2, 2), (4, 1)]:
        cut_gen._generator.state.assign(start)
        window = _running.BatchWindow(tf.constant(begin), size, 5)
        piece = _tf_keras._window_numbers(cut_gen, None, [size] + shape[1:], tf.as_dtype(dtype),
                                          window)
        np.testing.assert_array_equal(piece.numpy(), whole[begin:begin + size])
        np.testing.assert_array_equal(cut_gen._generator.state.numpy(),
                                      whole_gen._generator.state.numpy())
    assert _tf.numbers_per_step(tf.float64) == 2


@pytest.mark.parametrize("signature, cut, jit, cuts", [
    ([5, None, 8], 2, False, 1), ([5, None, 8], None, False, 1), ([None, 6, 8], 2, False, 1),
    ([None, None, 8], None, False, 1), ([None, None, 8], 2, True, 0)],
    ids=["sequence-unknown", "sequence-unknown-rule", "batch-unknown", "both-unknown",
         "xla-runs-whole"])
def test_shapes_known_only_when_the_step_runs(replayable_rng, monkeypatch, signature, cut,
                                              jit, cuts):
    """Two declared blocks in a row traced with the batch, the sequence length or both
    unknown (tf_keras's `fit`; `padded_batch`): the cuts are counted when the step runs --
    `batch_cut(2)`, or the rule's from the sequence length (here 12 rows a cut: 2 samples)
    -- the incoming gradients cut like the outputs; under XLA such a call runs whole. Every
    run equals RECOMPUTE=0's."""
    from recompute.engine import _batch_cut

    monkeypatch.setattr(_batch_cut, "TF_CUT_ROWS", 12)
    tf_keras.utils.set_random_seed(0)
    first, second = _block(seq=None), _block(seq=None)
    x = tf_keras.Input((None, 8))
    model = tf_keras.Model(x, second(first(x)))
    model(tf.zeros([1, 6, 8]), training=True)  # the generators made
    start = [v.numpy() for v in _variables(model)]
    cutting = count_cut_recomputations(monkeypatch)
    results = []
    for on in (False, True):
        for v, value in zip(_variables(model), start):
            v.assign(value)
        results.append(_run(model, on, cut, signature, jit))
    assert cutting["n"] == 2 * cuts
    for step in range(2):
        assert_all_close(results[0][step], results[1][step])
