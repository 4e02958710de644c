"""recompute_grad(policy=...) on a standard Keras 3 transformer block: every policy
gives the loss and gradients of the undecorated block; "attention" recomputes only
the attention cores and keeps no [heads, seq, seq] tensor for the backward pass.
(The tests shared with the tf_keras suite: tests.helpers.attention_blocks.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers import attention_blocks as blocks
from tests.helpers.attention_blocks import *  # noqa: F403 (the shared tests, collected here)
from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.numerics import assert_all_close, to_numpy


def test_policy_off_runs_as_written():
    loss0, grads0, _, _, _ = blocks.run(keras, None, False, "function")
    loss1, grads1, counts1, _, _ = blocks.run(keras, "attention", False, "function")
    assert counts1 == {"block": 2, "core": 2}
    assert loss0 == loss1
    assert_all_close(grads0, grads1, rtol=0)


def test_bad_policies_are_refused():
    assert recompute.POLICIES == ("full", "attention")
    with pytest.raises(ValueError, match=r"`policy` must be one of 'full', 'attention'. Received: policy='block'"):
        recompute_grad(policy="block")
    with pytest.raises(TypeError, match=r"keyword argument: `@recompute_grad\(policy='attention'\)`"):
        recompute_grad("attention")


def test_einsum_dense_of_another_dtype_runs_as_written():
    """An `EinsumDense` whose kernel's dtype is not its input's (the layer promotes) runs as
    written under `recompute.ops._lean.lean_layers`, fed a lean LayerNorm's output.
    (tf_keras's `EinsumDense` does not promote: it refuses mixed dtypes itself.)"""
    from recompute.adapters import _keras3
    from recompute.ops import _lean

    norm = keras.layers.LayerNormalization(dtype="float64")
    proj = keras.layers.EinsumDense("abc,cd->abd", (blocks.SEQ, blocks.WIDTH), autocast=False)
    x = tf.cast(tf.random.stateless_normal([blocks.BATCH, blocks.SEQ, blocks.WIDTH],
                                           seed=(11, 12)), tf.float64)
    proj(norm(x))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(tf.cast(proj(norm(x)), tf.float64)))
        return tape.gradient(loss, [x] + proj.trainable_weights)

    expected = to_numpy(tf.function(step)(x))
    with _lean.lean_layers([norm, proj], _keras3.tf_variable):
        got = to_numpy(tf.function(step)(x))
    for a, b in zip(expected, got):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_einsum_gradient_equations():
    """The input's and the kernel's gradient equations of an `EinsumDense`, or None where they
    are not two plain einsums."""
    from recompute.ops._lean import einsum_gradient_equations as equations

    assert equations("abc,cde->abde") == ("abde,cde->abc", "abc,abde->cde")
    assert equations("abcd,cde->abe") == ("abe,cde->abcd", "abcd,abe->cde")
    assert equations("ab,bc->ac") == ("ac,bc->ab", "ab,ac->bc")
    for refused in ("...b,bc->...c", "abc,cd->ad", "ab,bcd->ac", "aab,bc->ac", "ab->ab",
                    "ab,bc,cd->ad", "ab,bc", None):
        assert equations(refused) is None, refused
