"""recompute_grad(policy=...) on a standard Keras 3 transformer block: every policy
gives the loss and gradients of the undecorated block; "attention" recomputes only
the attention cores and keeps no [heads, seq, seq] tensor for the backward pass.
(The tests shared with the tf_keras suite: tests.helpers.attention_blocks.)"""

import keras
import pytest

import recompute
from recompute import recompute_grad
from tests.helpers import attention_blocks as blocks
from tests.helpers.attention_blocks import *  # noqa: F403 (the shared tests, collected here)
from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.numerics import assert_all_close


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
