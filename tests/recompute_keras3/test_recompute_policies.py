"""recompute_grad(policy=...) on a standard Keras 3 transformer block: every policy
gives the loss and gradients of the undecorated block; "attention" recomputes only
the attention cores and keeps no [heads, seq, seq] tensor for the backward pass.
(The checks are shared with the tf_keras suite: tests.helpers.attention_blocks.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers import attention_blocks as blocks
from tests.helpers.numerics import assert_all_close


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("policy", ["full", "attention"])
@pytest.mark.parametrize("block", [None, 4, pytest.param(1, marks=pytest.mark.slow)])
def test_policy_matches_no_recompute(policy, mode, block):
    blocks.check_policy_matches(keras, policy, mode, block)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_blocked_cores_used(policy, monkeypatch):
    blocks.check_blocked_cores_used(keras, policy, monkeypatch)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_backward_holds_no_attention_matrix(policy):
    blocks.check_backward_holds_no_attention_matrix(keras, policy)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_gelus_keep_their_input(policy, monkeypatch):
    blocks.check_gelus_keep_their_input(keras, policy, monkeypatch)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(policy):
    blocks.check_fit_matches(keras, policy)


def test_attention_policy_keeps_no_attention_matrix():
    blocks.check_attention_policy_keeps_no_attention_matrix(keras)


def test_attention_policy_recomputation_draws_no_random_numbers():
    blocks.check_recomputation_draws_nothing(keras)


def test_policy_off_runs_as_written():
    loss0, grads0, _, _, _ = blocks.run(keras, None, False, "function")
    loss1, grads1, counts1, _, _ = blocks.run(keras, "attention", False, "function")
    assert counts1 == {"block": 2, "core": 2}
    assert loss0 == loss1
    assert_all_close(grads0, grads1, rtol=0)


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_attention_policy_without_attention_layer_is_refused(on):
    blocks.check_attention_policy_needs_attention_layers(keras, on)


def test_bad_policies_are_refused():
    assert recompute.POLICIES == ("full", "attention")
    with pytest.raises(ValueError, match=r"`policy` must be one of 'full', 'attention'. Received: policy='block'"):
        recompute_grad(policy="block")
    with pytest.raises(TypeError, match=r"keyword argument: `@recompute_grad\(policy='attention'\)`"):
        recompute_grad("attention")
