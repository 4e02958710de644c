"""recompute.bert4keras: the lean attention core (and, under "attention", the lean
feed-forward layer) used with recomputation on (own process: TF_KERAS=1
TF_USE_LEGACY_KERAS=1)."""

import os

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import recompute  # noqa: E402
import recompute.bert4keras as rb  # noqa: E402
from recompute.bert4keras import _attention, _feed_forward, _patch  # noqa: E402

rb.patch()

import tensorflow as tf  # noqa: E402
import bert4keras.layers as B  # noqa: E402
from bert4keras.models import build_transformer_model  # noqa: E402

from tests.helpers import tiny_bert  # noqa: E402
from tests.helpers.attention_blocks import (  # noqa: E402
    check_mask_kept_as_bits, forward_tensors_kept, forward_tensors_read_by_backward)
from tests.helpers.numerics import assert_all_close, to_numpy  # noqa: E402

SEQ = 10

# Every test here is of the blocked core, named: at SEQ the rule ("auto") runs bert4keras's own
# core on TensorFlow (up to 512 keys: `test_rule_runs_bert4keras_core_up_to_512_keys`).
pytestmark = pytest.mark.usefixtures("blocked_core")


@pytest.fixture
def config_path(tmp_path):
    """Dropout on; key size 16 (a power of 4: the folded scale 1/4 is exact)."""
    return str(tiny_bert.write_config(tmp_path, hidden_size=64, hidden_dropout_prob=0.1,
                                      attention_probs_dropout_prob=0.2))


@pytest.fixture(autouse=True)
def replayable_rng():
    tf.keras.backend.experimental.enable_tf_random_generator()
    yield
    tf.keras.backend.experimental.disable_tf_random_generator()
    rb.patch()


@pytest.fixture
def lean_calls(monkeypatch):
    calls = []
    real = _attention.lean_pay_attention_to

    def counting(layer, *args, **kwargs):
        calls.append(layer.name)
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(_attention, "lean_pay_attention_to", counting)
    return calls


def batch():
    rng = np.random.RandomState(1)
    token_ids = rng.randint(1, 100, size=(3, SEQ))
    token_ids[1, 6:] = 0  # padding
    token_ids[2, 3:] = 0
    return token_ids, np.zeros_like(token_ids), np.array([0, 1, 1])


def build(config_path, **kwargs):
    tf.keras.utils.set_random_seed(0)
    bert = build_transformer_model(config_path, **kwargs)
    out = tf.keras.layers.Dense(2)(tf.keras.layers.Lambda(lambda x: x[:, 0])(bert.output))
    return tf.keras.Model(bert.inputs, out)


def loss_and_grads(model, token_ids, segment_ids, labels):
    with tf.GradientTape() as tape:
        logits = model([token_ids, segment_ids], training=True)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    return [float(loss)] + to_numpy(tape.gradient(loss, model.trainable_weights))


@pytest.mark.parametrize("policy", _patch.POLICIES)
def test_outputs_equal_bert4keras_bit_for_bit(config_path, lean_calls, monkeypatch, policy):
    """Dropout on, padding: RECOMPUTE=1 (lean core; lean feed-forward under
    "attention") gives bert4keras's own outputs exactly."""
    feed_forward_calls = []
    real = _feed_forward.lean_call
    monkeypatch.setattr(_feed_forward, "lean_call",
                        lambda layer, x: feed_forward_calls.append(layer.name) or real(layer, x))
    token_ids, segment_ids, _ = batch()
    outputs = []
    for on in (False, True):
        rb.patch(policy=policy)
        with recompute.recompute_scope(on):  # built with recomputation on, as with RECOMPUTE=1
            model = build(config_path)
            lean_calls.clear()
            outputs.append(np.asarray(model([token_ids, segment_ids], training=True)))
        assert len(lean_calls) == (2 if on else 0)
    assert len(feed_forward_calls) == (2 if policy == "attention" else 0)
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("policy", _patch.POLICIES)
def test_attention_dropout_drawn_once_per_step(config_path, monkeypatch, policy):
    """With a tape, dropout on and padding: each attention layer's dropout runs once
    per step (its bool decision is kept, not redrawn by the recomputation), and
    the loss and gradients equal RECOMPUTE=0's."""
    draws = []
    real = _attention._decision
    monkeypatch.setattr(_attention, "_decision", lambda *a, **k: draws.append(1) or real(*a, **k))
    token_ids, segment_ids, labels = batch()
    results = []
    for on in (False, True):
        rb.patch(policy=policy)
        with recompute.recompute_scope(on):
            model = build(config_path)
            draws.clear()
            results.append(loss_and_grads(model, token_ids, segment_ids, labels))
        assert len(draws) == (2 if on else 0)  # 2 layers; bert4keras's own code at RECOMPUTE=0
    assert_all_close(results[0], results[1])


def _loss_and_grads_under(config_path, policy, on):
    """`loss_and_grads` of a model built and run under `policy` with recomputation `on`."""
    rb.patch(policy=policy)
    with recompute.recompute_scope(on):
        return loss_and_grads(build(config_path), *batch())


@pytest.mark.parametrize("policy", _patch.POLICIES)
def test_core_rows_follow_the_policy(config_path, monkeypatch, policy):
    """The lean core's query rows per block follow the rule by the policy the patch passes
    (`recompute.ops._flash.block_rows`): one block of every row under "attention" and the
    whole-block policies ("block", "block_keep_ffn"), tiles of `DEFAULT_BLOCK_ELEMENTS`
    (query, key) pairs under "layer" (here lowered to 4 rows of SEQ keys); the loss and
    every gradient RECOMPUTE=0's."""
    from recompute.ops import _flash, _flash_tf

    monkeypatch.setattr(_flash, "DEFAULT_BLOCK_ELEMENTS", 4 * SEQ)
    rows = []
    real = _flash_tf.attention

    def recording(logits, query, key, value, mask, bits, rate, block, *args, **kwargs):
        rows.append(block)
        return real(logits, query, key, value, mask, bits, rate, block, *args, **kwargs)

    monkeypatch.setattr(_flash_tf, "attention", recording)
    results = [_loss_and_grads_under(config_path, policy, on) for on in (False, True)]
    rows = {r for r in rows if r is not None}  # (None: built on symbolic inputs)
    assert rows == {4 if policy == "layer" else SEQ}
    assert_all_close(results[0], results[1])


def test_lean_feed_forward_gradients_match_autodiff(config_path):
    """The hand-written gradient of GELU then the second dense layer, checked
    alone against TensorFlow's autodiff of the layer (RECOMPUTE=0)."""
    rb.patch(policy="attention")
    layer = B.FeedForward(48, activation="gelu", name="ffn")
    x = tf.constant(np.random.RandomState(0).randn(3, SEQ, 64), tf.float32)
    layer(x)
    assert _feed_forward.lean_applies(layer, x)
    results = []
    for on in (False, True):
        with recompute.recompute_scope(on), tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * tf.sin(y))
        results.append([y.numpy()] + to_numpy(tape.gradient(loss, [x] + layer.trainable_weights)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert_all_close(results[0], results[1])


def test_inference_and_no_dropout_equal_too(config_path, lean_calls):
    token_ids, segment_ids, _ = batch()
    outputs = []
    for on in (False, True):
        model = build(config_path)
        with recompute.recompute_scope(on):
            outputs.append(np.asarray(model([token_ids, segment_ids], training=False)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert len(lean_calls) == 2


@pytest.mark.parametrize("policy", ["layer", "attention"])
def test_language_model_causal_bias_is_blocked(config_path, lean_calls, policy):
    """A language model's causal attention bias (`a_bias`) runs in the blocked core too
    (blocks of 4 rows: the bias is cut with the queries); gradients exact."""
    token_ids, segment_ids, labels = batch()
    results = []
    for on in (False, True):
        rb.patch(policy=policy)
        model = build(config_path, application="lm")
        with recompute.recompute_scope(on), recompute.attention_block_size(4):
            lean_calls.clear()
            results.append(loss_and_grads(model, token_ids, segment_ids, labels))
        # 2 layers; "layer" runs each core again in its recomputation
        assert len(lean_calls) == (0 if not on else 2 if policy == "attention" else 4)
    assert_all_close(results[0], results[1])


@pytest.mark.parametrize("policy", ["layer", "attention"])
def test_non_standard_attention_runs_bert4keras_code(config_path, lean_calls, policy):
    """RoFormer's rotary position bias (`p_bias`) is not the standard case: bert4keras's own
    core runs (recomputed), gradients still exact."""
    token_ids, segment_ids, labels = batch()
    results = []
    for on in (False, True):
        rb.patch(policy=policy)
        model = build(config_path, model="roformer")
        with recompute.recompute_scope(on):
            results.append(loss_and_grads(model, token_ids, segment_ids, labels))
    assert lean_calls == []
    assert_all_close(results[0], results[1])


def test_blocked_core_keeps_no_attention_matrix():
    """Under a tape, the [.., seq, seq] float tensors the gradient reads: bert4keras's
    core keeps several; the blocked core none (its dropout decision is kept as bits)."""
    rb.patch(policy="layer")
    layer = B.MultiHeadAttention(heads=4, head_size=16, attention_dropout=0.2)
    layer.build([[None, SEQ, 64]] * 3)
    rng = np.random.RandomState(0)
    qkv = [tf.constant(rng.randn(2, SEQ, 4, 16), tf.float32) for _ in range(3)]
    v_mask = tf.constant(np.arange(SEQ)[None, :] < np.array([[SEQ], [4]]))
    own = _patch._replaced[B.MultiHeadAttention, "pay_attention_to"]
    dropout = tf.keras.layers.Dropout(0.2)

    def graph(core):
        @tf.function
        def step(q, k, v):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                o, _ = core(q, k, v)
                loss = tf.reduce_sum(o * o)
            return tape.gradient(loss, [q, k, v])

        return step.get_concrete_function(*qkv).graph

    def lean(q, k, v):
        return _attention.lean_pay_attention_to(
            layer, [q, k, v], [None, v_mask], lambda rate: lambda x: dropout(x, training=True))

    def bert4keras(q, k, v):
        # inside pay_attention_to: its Dropout is one sublayer (`_owned_dropout`)
        with _patch._attending.entered(layer), tf.keras.backend.learning_phase_scope(1):
            return own(layer, [q, k, v], [None, v_mask])

    assert forward_tensors_kept(graph(lean), (SEQ, SEQ)) == set()
    assert len(forward_tensors_kept(graph(bert4keras), (SEQ, SEQ))) >= 3


@pytest.mark.parametrize("cuts", [False, True], ids=["whole", "cuts"])
@pytest.mark.parametrize("policy", _patch.POLICIES)
def test_dropout_decision_kept_as_bits(config_path, policy, cuts):
    """Every policy keeps each attention layer's dropout decision from the forward
    to the backward pass as bits (1 bit per entry, not a bool [.., seq, seq]
    mask), unpacked once the gradient arrives; the step still equals RECOMPUTE=0.
    With the whole-block policies' blocks in cuts of the batch (the batch unknown when
    traced: cuts counted when the step runs), the bits cross by cut, in arrays of uint8."""
    if cuts and policy not in _patch.BLOCK_POLICIES:
        pytest.skip("only the whole-block policies run blocks in cuts")
    token_ids, segment_ids, labels = batch()
    rb.patch(policy=policy)
    with recompute.recompute_scope(True), recompute.batch_cut(2 if cuts else 0):
        model = build(config_path)

        @tf.function
        def step(token_ids, segment_ids, labels):
            with tf.GradientTape() as tape:
                logits = model([token_ids, segment_ids], training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True))
            return tape.gradient(loss, model.trainable_weights)

        graph = step.get_concrete_function(
            tf.TensorSpec([None, SEQ], tf.int32), tf.TensorSpec([None, SEQ], tf.int32),
            tf.TensorSpec([None], tf.int32)).graph
    if not cuts:
        check_mask_kept_as_bits(graph, SEQ)
        return
    read = forward_tensors_read_by_backward(graph)
    assert not [t.name for t in read if t.dtype == tf.bool and t.shape.rank is not None
                and t.shape.rank >= 3 and tuple(t.shape[-2:]) == (SEQ, SEQ)]
    arrays = [op for op in graph.get_operations() if op.type == "TensorListReserve"
              and op.get_attr("element_dtype") == tf.uint8]
    assert len(arrays) == 2, [op.name for op in arrays]  # one per block: its bits, by cut
    masks = [op.name for op in graph.get_operations() if op.type == "TensorListReserve"
             and op.get_attr("element_dtype") == tf.bool
             and len(tf.get_static_value(op.inputs[0])) >= 3]
    assert not masks, masks  # (the padding mask [batch, seq] is joined by cut: rank 2)


@pytest.mark.parametrize("core", ["auto", "blocked", "keras"])
def test_rule_runs_bert4keras_core_up_to_512_keys(core):
    """`lean_applies` follows `recompute.ops._flash.runs_blocked`: under "auto" bert4keras's own
    core up to 512 keys and where the length is known only when the core runs, the blocked
    core beyond; under policy="attention" and bert4keras's whole-block policies ("block")
    the blocked core up to 512 keys too (not where the
    length is known only when the core runs); `attention_core` overrides it; half
    precision runs bert4keras's own core."""
    layer = B.MultiHeadAttention(heads=2, head_size=4)

    def applies(keys, queries=None, dtype=tf.float32, policy=None):
        if keys is None:  # symbolic: a length known only when the core runs
            q = k = tf.keras.Input((None, 2, 4), dtype=dtype)
        else:
            q, k = tf.zeros([1, queries or keys, 2, 4], dtype), tf.zeros([1, keys, 2, 4], dtype)
        return _attention.lean_applies(layer, [q, k, k], {}, policy)

    with recompute.attention_core(core):
        for policy in (None, "full", "attention", "block"):
            expected = {"auto": [policy in ("attention", "block")] * 2
                        + [True, True, True, False],
                        "blocked": [True] * 6, "keras": [False] * 6}[core]
            assert [applies(SEQ, policy=policy), applies(512, policy=policy),
                    applies(513, policy=policy), applies(1024, policy=policy),
                    applies(2048, 1, policy=policy), applies(None, policy=policy)] == expected
            assert not applies(2048, dtype=tf.float16, policy=policy)
            assert not applies(SEQ, dtype=tf.float16, policy=policy)
