"""recompute_grad(policy=...) on a standard tf_keras transformer block (the Keras 3
suite's tests, on tf_keras's MultiHeadAttention)."""

import pytest
import tf_keras as K

from tests.helpers import attention_blocks as blocks
from tests.helpers.numerics import assert_all_close


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG: RECOMPUTE=1 then draws the masks RECOMPUTE=0 draws."""
    K.backend.experimental.enable_tf_random_generator()
    yield


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("policy", ["full", "attention"])
def test_policy_matches_no_recompute(policy, mode):
    loss0, grads0, counts0, _, model = blocks.run(K, None, False, mode)
    loss1, grads1, counts1, _, _ = blocks.run(K, policy, True, mode)
    names = ["input"] + [v.name for v in model.trainable_variables]
    assert_all_close([loss0], [loss1], ["loss"])
    assert_all_close(grads0, grads1, names)
    assert counts0 == {"block": 2, "core": 2}
    assert counts1 == ({"block": 4, "core": 4} if policy == "full" else {"block": 2, "core": 4})


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(policy):
    want = blocks.fit_weights(K, None, False)
    got = blocks.fit_weights(K, policy, True)
    assert_all_close(want, got)


def test_attention_policy_keeps_no_attention_matrix():
    kept_off = blocks.forward_tensors_kept(blocks.run(K, None, False, "function")[3])
    kept_on = blocks.forward_tensors_kept(blocks.run(K, "attention", True, "function")[3])
    assert "Softmax" in kept_off
    assert not kept_on, kept_on
