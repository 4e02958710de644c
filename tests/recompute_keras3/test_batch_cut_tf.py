"""`recompute.batch_cut` on TensorFlow (`recompute.engine._cuts_tf`): under "full" a recomputed
Keras 3 block of Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers runs its
batch in cuts, in both passes. Its loss and every gradient equal RECOMPUTE=0's (float
rounding: the weights' gradients are summed over the cuts), its dropouts drawing the whole
batch's numbers for each cut (`recompute.ops._window_tf`), the seed states advancing once; a
call that adds a loss runs whole; in eager mode, `tf.function`, XLA and `fit`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad, recompute_scope
from recompute.engine import _cuts_tf, _running
from recompute.engine._batch_cut import CUT_ROWS, TF_CUT_ROWS, samples_per_cut
from recompute.ops import _flash_tf, _window_tf
from tests.helpers.numerics import assert_all_close, max_rel_err


@pytest.fixture(autouse=True)
def _default_cut_after():
    yield
    recompute.batch_cut(None)


class Block(keras.layers.Layer):
    """A standard Keras 3 block: attention (a mask from the call), two LayerNormalizations, a
    feed-forward pair, dropouts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.3, seed=1)
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()
        self.up, self.down = keras.layers.Dense(32, activation="gelu"), keras.layers.Dense(16)
        self.drop = keras.layers.Dropout(0.3, seed=2)

    @recompute_grad
    def call(self, x, mask=None, training=None):
        return self.body(x, mask, training)

    def body(self, x, mask, training):
        a = self.attention(x, x, attention_mask=mask, training=training)
        x = self.norm1(x + self.drop(a, training=training))
        return self.norm2(x + self.drop(self.down(self.up(x)), training=training))


class LossBlock(Block):
    """A block whose call adds a loss: it runs whole."""

    @recompute_grad
    def call(self, x, mask=None, training=None):
        y = self.body(x, mask, training)
        self.add_loss(tf.reduce_mean(y**2))
        return y


def _model(block=Block, seq=8):
    keras.utils.set_random_seed(0)
    x, mask = keras.Input((seq, 16)), keras.Input((seq, seq), dtype="bool")
    return keras.Model([x, mask], block()(block()(x, mask), mask))


def _inputs(batch, seq=8):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(batch, seq, 16)).astype("float32")
    mask = np.ones((batch, seq, seq), bool)
    mask[:, :, 6:] = False
    mask[1, :, 3:] = False
    return [tf.constant(x), tf.constant(mask)]


def _step(model, on, inputs, mode):
    """The loss, every gradient and the seed states after one step (the states then put
    back)."""
    state = [v.numpy() for v in model.non_trainable_variables]

    def step(x, mask):
        with tf.GradientTape() as tape:
            y = model([x, mask], training=True)
            loss = tf.reduce_mean(y**2) + sum(model.losses)
        return loss, tape.gradient(loss, model.trainable_variables)

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    with recompute_scope(on):
        loss, grads = step(*inputs)
    after = [v.numpy() for v in model.non_trainable_variables]
    for v, s in zip(model.non_trainable_variables, state):
        v.assign(s)
    return float(loss), [g.numpy() for g in grads], after


def _cuts_seen(monkeypatch):
    """The samples of each cut the forward passes run (a list filled as they run)."""
    seen = []
    original = _cuts_tf.CutRecomputation._forward_cut

    def spy(self, inputs, window, *args, **kwargs):
        seen.append(window.size)
        return original(self, inputs, window, *args, **kwargs)

    monkeypatch.setattr(_cuts_tf.CutRecomputation, "_forward_cut", spy)
    return seen


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("batch", [5, 6])
def test_cuts_equal_recompute_off(monkeypatch, mode, batch):
    """Cuts of 2 samples (5: a first cut, a loop of one, a rest of 1; 6: a first cut and a
    loop of two), with a boolean mask (cut too) and dropout: the loss and every gradient
    equal RECOMPUTE=0's, the seed states advance alike, and each block's forward pass ran
    its cuts."""
    model = _model()
    inputs = _inputs(batch)
    loss0, grads0, state0 = _step(model, False, inputs, mode)
    seen = _cuts_seen(monkeypatch)
    with recompute.batch_cut(2):
        loss1, grads1, state1 = _step(model, True, inputs, mode)
    # eager: every cut; traced: the first cut, the loop's body once, the rest
    cuts = [2] * (batch // 2 if mode == "eager" else 2) + [1] * (batch % 2)
    assert seen == cuts * 2, seen
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])
    assert all(np.array_equal(a, b) for a, b in zip(state0, state1))


@pytest.mark.parametrize("cut", [2, 0])
def test_the_attention_dropout_is_drawn_once_a_step(monkeypatch, cut):
    """Under "full", Keras's own core (seq 8): its dropout's decision is drawn in the forward
    pass only, as bits kept for the recomputation -- by cut where the batch is cut (eager:
    each of the 3 cuts of each block once), else once a block -- and the values are
    RECOMPUTE=0's."""
    model = _model()
    inputs = _inputs(5)
    loss0, grads0, _ = _step(model, False, inputs, "eager")
    draws = []
    original = _flash_tf.stateless_keep_bits
    monkeypatch.setattr(_flash_tf, "stateless_keep_bits",
                        lambda *a: draws.append(a[1]) or original(*a))
    with recompute.batch_cut(cut):
        loss1, grads1, _ = _step(model, True, inputs, "eager")
    assert len(draws) == (3 if cut else 1) * 2, draws
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_all_close(grads0, grads1)


@pytest.mark.parametrize("core,seq", [("blocked", 8), ("blocked", 7), ("auto", 7)])
def test_cuts_with_either_core(core, seq):
    """The FlashAttention-2 core in cuts (`attention_core("blocked")`), and Keras's (the
    rule's here) with its decision kept: the dropout's bits drawn for the cut's rows of the
    batch's draw (seq 8: 128 numbers a sample, on a step of the counter), or by the windowed
    `Dropout` (seq 7: 98, not on a step); the loss and every gradient RECOMPUTE=0's."""
    model = _model(seq=seq)
    inputs = _inputs(5, seq)
    loss0, grads0, state0 = _step(model, False, inputs, "function")
    with recompute.batch_cut(2), recompute.attention_core(core):
        loss1, grads1, state1 = _step(model, True, inputs, "function")
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])
    assert all(np.array_equal(a, b) for a, b in zip(state0, state1))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_cuts_in_half_precision(monkeypatch, policy):
    """Half precision (eager: every op as written), cuts of 2 of a batch of 5: the loss and
    every gradient within half-precision rounding of RECOMPUTE=0's own half-precision
    numbers (the weights' gradients are summed over the cuts in another order), the
    dropouts the same (the seed states too), and the blocks computed in half precision."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        model = _model()
        inputs = _inputs(5)
        loss0, grads0, state0 = _step(model, False, inputs, "eager")
        seen = _cuts_seen(monkeypatch)
        with recompute.batch_cut(2):
            loss1, grads1, state1 = _step(model, True, inputs, "eager")
    finally:
        keras.config.set_dtype_policy(previous)
    assert model.layers[2].compute_dtype == policy.split("_")[1]
    assert seen == [2, 2, 1] * 2, seen
    assert abs(loss0 - loss1) <= 1e-2 * abs(loss0), (loss0, loss1)
    for name, a, b in zip([v.path for v in model.trainable_variables], grads0, grads1):
        assert max_rel_err(a, b) < 2e-2, (name, max_rel_err(a, b))
    assert all(np.array_equal(a, b) for a, b in zip(state0, state1))


def test_the_window_is_what_draws_the_batch_dropout(monkeypatch):
    """Without the window (each cut drawing its own numbers) the gradients are others: the
    comparison above sees the dropouts."""
    model = _model()
    inputs = _inputs(5)
    _, grads0, _ = _step(model, False, inputs, "function")
    monkeypatch.setattr(_running, "batch_window", lambda: None)
    with recompute.batch_cut(2):
        _, grads1, _ = _step(model, True, inputs, "function")
    with pytest.raises(AssertionError):
        assert_all_close(grads0, grads1)


def test_a_call_that_adds_a_loss_runs_whole(monkeypatch):
    """The first cut adds a loss: the call runs whole, its loss and gradients RECOMPUTE=0's."""
    model = _model(LossBlock)
    inputs = _inputs(5)
    loss0, grads0, _ = _step(model, False, inputs, "function")
    seen = _cuts_seen(monkeypatch)
    with recompute.batch_cut(2):
        loss1, grads1, _ = _step(model, True, inputs, "function")
    assert seen == [2, 2], seen  # each block: the first cut, then whole
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_all_close(grads0, grads1)


def test_fit_with_a_partial_batch():
    """`fit` over 7 samples in batches of 3 (the last of 1), cuts of 2: the weights equal
    RECOMPUTE=0's after an epoch."""
    x, mask = _inputs(7)
    y = np.zeros((7, 8, 16), "float32")
    weights = []
    for on in (False, True):
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with recompute_scope(on), recompute.batch_cut(2):
            model.fit([x, mask], y, batch_size=3, epochs=1, shuffle=False, verbose=0)
        weights.append([v.numpy() for v in model.trainable_variables])
    assert_all_close(weights[0], weights[1])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_window_uniform_is_the_whole_draw_cut(dtype, jit):
    """`window_uniform` draws exactly the whole batch's `stateless_uniform` numbers of the
    window's samples: TensorFlow's kernels and XLA, every float type, a start not on a step
    of the counter."""
    seed = tf.constant([1234, 56], tf.int32)
    shape = [6, 3, 5, 7]

    def draws():
        whole = tf.random.stateless_uniform(shape, seed=seed, dtype=dtype)
        pieces = [_window_tf.window_uniform(seed, [size] + shape[1:], tf.as_dtype(dtype),
                                            _running.BatchWindow(tf.constant(start), size, 6))
                  for start, size in [(0, 6), (1, 2), (3, 3), (5, 1)]]
        return whole, pieces

    whole, pieces = tf.function(draws, jit_compile=True)() if jit else draws()
    for (start, size), piece in zip([(0, 6), (1, 2), (3, 3), (5, 1)], pieces):
        np.testing.assert_array_equal(piece.numpy(), whole.numpy()[start:start + size])


def test_the_rule_on_tensorflow():
    """By default a cut holds about `TF_CUT_ROWS` rows on TensorFlow where it sees no GPU (2
    samples at seq 512), `CUT_ROWS` where it sees one (8); `batch_cut` sets it for both
    engines."""
    rows = CUT_ROWS if tf.config.list_logical_devices("GPU") else TF_CUT_ROWS
    assert samples_per_cut(512, "tensorflow") == rows // 512 == (8 if rows == CUT_ROWS else 2)
    assert samples_per_cut(10**6, "tensorflow") == 1
    with recompute.batch_cut(3):
        assert samples_per_cut(512, "tensorflow") == 3
    with recompute.batch_cut(0):
        assert samples_per_cut(512, "tensorflow") is None
