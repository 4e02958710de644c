"""recompute.engine._core.kept: what a recomputed call's forward pass keeps for its recomputation
instead of computing it again (the attention dropout's bool mask)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute.engine import _core
from recompute import recompute_grad
from tests.helpers.numerics import to_numpy

COMPUTED = {"n": 0}


class MaskedBlock(keras.layers.Layer):
    """Dense, then a dropout-like mask drawn from a seed generator inside `kept`."""

    def __init__(self, branches=None, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.seed = keras.random.SeedGenerator(7)
        self.branches = branches  # a list of how many `kept` calls each run makes

    def build(self, input_shape):
        self.dense.build(input_shape)

    def mask(self, shape):
        COMPUTED["n"] += 1
        return keras.random.uniform(shape, seed=self.seed) > 0.4

    def call(self, x):
        h = self.dense(x)
        runs = self.branches.pop(0) if self.branches else 1
        for _ in range(runs):
            keep = _core.kept(lambda: self.mask(tf.shape(h)))
        return tf.where(keep, h * 2.0, 0.0)


def _step(block, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = block(x)
        loss = tf.reduce_sum(y * tf.sin(y))
    return [loss] + tape.gradient(loss, [x] + block.trainable_variables)


def _block(decorated, branches=None):
    keras.utils.set_random_seed(1)
    block = MaskedBlock(branches)
    block.build((3, 5))
    if decorated:
        block.call = recompute_grad(block.call)
    return block


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_kept_result_is_not_computed_again(compile_mode):
    x = tf.constant(np.random.RandomState(0).randn(3, 5), tf.float32)
    results, counts = [], []
    for on in (False, True):
        block = _block(on)
        step = _step if compile_mode == "eager" else tf.function(_step)
        COMPUTED["n"] = 0
        with recompute.recompute_scope(on):
            results.append(to_numpy(step(block, x)))
        counts.append(COMPUTED["n"])
    # The same mask (seeded the same), the same loss and gradients, bit for bit.
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # Computed in the forward pass only: as often as without recomputation (once
    # eagerly; once per trace in a function, which Keras may trace twice).
    assert counts[0] == counts[1] and (counts[0] == 1 or compile_mode == "function")


def test_kept_outside_a_recomputed_call_computes():
    COMPUTED["n"] = 0
    assert _core.kept(lambda: COMPUTED.__setitem__("n", COMPUTED["n"] + 1) or 5) == 5
    assert COMPUTED["n"] == 1


def test_a_recomputation_that_asks_for_more_is_refused():
    x = tf.constant(np.random.RandomState(0).randn(3, 5), tf.float32)
    block = _block(True, branches=[1, 2])  # forward: one `kept`, recomputation: two
    with recompute.recompute_scope(True):
        with pytest.raises(RuntimeError, match="kept 1 results with `kept` in the forward pass "
                                               "but asked for 2"):
            _step(block, x)


@pytest.mark.parametrize("mode", ["eager", "function", "dynamic", "jit"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 2, 8, 8), (3,), (0, 4), (2, 1, 3, 17)])
def test_mask_bits_round_trip(shape, mode):
    """`_flash_tf.pack` keeps a bool mask as 1 bit per entry along its last axis, and the
    engine's `unpack` gives it back exactly, for sizes that are and are not multiples
    of 8, with static and unknown shapes and under XLA."""
    from recompute.ops import _flash_tf

    mask = tf.constant(np.random.RandomState(0).rand(*shape) < 0.7)

    def round_trip(m):
        bits = _flash_tf.pack(m)
        keys = m.shape[-1] if m.shape[-1] is not None else tf.shape(m)[-1]
        return bits, _flash_tf.ENGINE.unpack(bits, keys)

    if mode == "eager":
        fn = round_trip
    elif mode == "dynamic":
        fn = tf.function(round_trip, input_signature=[tf.TensorSpec([None] * len(shape), tf.bool)])
    else:
        fn = tf.function(round_trip, jit_compile=mode == "jit")
    bits, back = fn(mask)
    assert bits.dtype == tf.uint8 and tuple(bits.shape) == shape[:-1] + (-(-shape[-1] // 8),)
    np.testing.assert_array_equal(back.numpy(), mask.numpy())
