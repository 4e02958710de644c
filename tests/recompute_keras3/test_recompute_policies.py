"""recompute_grad(policy=...) on a standard Keras 3 transformer block: every policy
gives the loss and gradients of the undecorated block; "attention" recomputes only
the attention cores and keeps no [heads, seq, seq] tensor for the backward pass."""

import keras
import pytest

from recompute import recompute_grad
from tests.helpers import attention_blocks as blocks
from tests.helpers.numerics import assert_all_close

MODES = ["eager", "function", "jit"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["full", "attention"])
def test_policy_matches_no_recompute(policy, mode):
    loss0, grads0, counts0, _, model = blocks.run(keras, None, False, mode)
    loss1, grads1, counts1, _, _ = blocks.run(keras, policy, True, mode)
    names = ["input"] + [v.path for v in model.trainable_variables]
    assert_all_close([loss0], [loss1], ["loss"])
    assert_all_close(grads0, grads1, names)
    assert counts0 == {"block": 2, "core": 2}
    # "full" runs every block twice; "attention" only the attention cores.
    assert counts1 == ({"block": 4, "core": 4} if policy == "full" else {"block": 2, "core": 4})


def test_policy_off_runs_as_written():
    loss0, grads0, _, _, _ = blocks.run(keras, None, False, "function")
    loss1, grads1, counts1, _, _ = blocks.run(keras, "attention", False, "function")
    assert counts1 == {"block": 2, "core": 2}
    assert loss0 == loss1
    assert_all_close(grads0, grads1, rtol=0)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(policy):
    want = blocks.fit_weights(keras, None, False)
    got = blocks.fit_weights(keras, policy, True)
    assert_all_close(want, got)


def test_attention_policy_keeps_no_attention_matrix():
    """The backward pass reads no [.., seq, seq] tensor of the forward pass (the
    softmax, dropout and scores are recomputed); without recomputation it does."""
    kept_off = blocks.forward_tensors_kept(blocks.run(keras, None, False, "function")[3])
    kept_on = blocks.forward_tensors_kept(blocks.run(keras, "attention", True, "function")[3])
    assert "Softmax" in kept_off
    assert not kept_on, kept_on


def test_attention_policy_without_attention_layer_is_refused():
    class NoAttention(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        @recompute_grad(policy="attention")
        def call(self, x):
            return self.dense(x)

    import recompute
    import tensorflow as tf

    layer = NoAttention()
    with recompute.recompute_scope(True), tf.GradientTape():
        with pytest.raises(ValueError, match=r"contains none.*policy='full'"):
            layer(tf.ones([1, 2]))


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match=r"`policy` must be one of 'full', 'attention'. Received: policy='block'"):
        recompute_grad(policy="block")
    with pytest.raises(TypeError, match=r"keyword argument: `@recompute_grad\(policy='attention'\)`"):
        recompute_grad("attention")
