"""recompute_grad(policy=...) on a standard tf_keras transformer block (the Keras 3
suite's checks, tests.helpers.attention_blocks, on tf_keras's MultiHeadAttention)."""

import pytest
import tf_keras as K

from tests.helpers import attention_blocks as blocks


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG: RECOMPUTE=1 then draws the masks RECOMPUTE=0 draws."""
    K.backend.experimental.enable_tf_random_generator()
    yield


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("policy", ["full", "attention"])
@pytest.mark.parametrize("block", [None, 4, pytest.param(1, marks=pytest.mark.slow)])
def test_policy_matches_no_recompute(policy, mode, block):
    blocks.check_policy_matches(K, policy, mode, block)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_blocked_cores_used(policy, monkeypatch):
    blocks.check_blocked_cores_used(K, policy, monkeypatch)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_backward_holds_no_attention_matrix(policy):
    blocks.check_backward_holds_no_attention_matrix(K, policy)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_gelus_keep_their_input(policy, monkeypatch):
    blocks.check_gelus_keep_their_input(K, policy, monkeypatch)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(policy):
    blocks.check_fit_matches(K, policy)


def test_attention_policy_keeps_no_attention_matrix():
    blocks.check_attention_policy_keeps_no_attention_matrix(K)


def test_attention_policy_recomputation_draws_no_random_numbers():
    blocks.check_recomputation_draws_nothing(K)


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_attention_policy_without_attention_layer_is_refused(on):
    blocks.check_attention_policy_needs_attention_layers(K, on)
