"""recompute.bert4keras: bert4keras models recompute exactly (own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1)."""

import os
import sys

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import recompute  # noqa: E402
import recompute.bert4keras as rb  # noqa: E402
import recompute.bert4keras._patch as rbp  # noqa: E402
from recompute.ops import _flash_tf  # noqa: E402

# The import hook must patch a bert4keras imported after `patch()`.
assert "bert4keras.layers" not in sys.modules
rb.patch()
rb.patch()  # idempotent

import tensorflow as tf  # noqa: E402
import bert4keras.layers as B  # noqa: E402
from bert4keras.models import build_transformer_model  # noqa: E402

from tests.helpers import tiny_bert  # noqa: E402
from tests.helpers.numerics import assert_all_close, to_numpy  # noqa: E402
from tests.helpers.recompute_runs import count_recomputed_calls  # noqa: E402



@pytest.fixture(params=rbp.POLICIES)
def policy(request):
    """Each policy: per marked layer (default), whole Transformer blocks, attention
    only, whole blocks keeping the feed-forward products."""
    rb.patch(policy=request.param)
    yield request.param
    rb.patch()


@pytest.mark.fast
def test_blocks_are_recomputed_units_with_unchanged_outputs(dropout_config_path):
    """A patched BERT is built with each Transformer block as one nested model;
    its outputs equal unpatched bert4keras's, padding included."""
    token_ids, segment_ids, _ = batch()
    rb.unpatch()
    try:
        tf.keras.utils.set_random_seed(0)
        plain = build_transformer_model(str(dropout_config_path))
    finally:
        rb.patch(blocks=True)
    try:
        tf.keras.utils.set_random_seed(0)
        patched = build_transformer_model(str(dropout_config_path))
    finally:
        rb.patch()
    assert "Transformer-0-MultiHeadSelfAttention" in [l.name for l in plain.layers]
    blocks = [l for l in patched.layers if l.name.startswith("Transformer-")]
    assert [b.name for b in blocks] == ["Transformer-0", "Transformer-1"]
    assert all(hasattr(b.call, "__recompute_grad_wrapped__") for b in blocks)
    assert "Transformer-1-FeedForward-Norm" in [l.name for l in blocks[1].layers]
    assert len(plain.weights) == len(patched.weights)
    np.testing.assert_array_equal(plain([token_ids, segment_ids]), patched([token_ids, segment_ids]))


def test_blocks_with_outside_inputs_are_recomputed_per_layer_with_a_warning(config_path):
    """A language model's blocks take a causal attention bias built outside them."""
    rbp._block_warned.clear()
    rb.patch(blocks=True)
    try:
        with pytest.warns(UserWarning, match="recomputed layer by layer.*attention bias"):
            model = build_transformer_model(str(config_path), application="lm")
    finally:
        rb.patch()
    names = [l.name for l in model.layers]
    assert "Transformer-0" not in names and "Transformer-0-MultiHeadSelfAttention" in names


def test_marked_layers_are_patched_and_unpatch_restores():
    names = {cls.__name__ for cls in rbp.marked_classes(B)}
    assert {"MultiHeadAttention", "FeedForward", "LayerNormalization"} <= names
    for cls in rbp.marked_classes(B):
        assert hasattr(cls.call, "__recompute_grad_wrapped__"), cls
    before = {cls: cls.__dict__["call"] for cls in rbp.marked_classes(B)}
    assert hasattr(B.MultiHeadAttention.pay_attention_to, "__wrapped__")
    assert hasattr(B.Dropout, "__wrapped__")
    rb.unpatch()
    assert not rb.is_patched()
    for cls in before:
        assert not hasattr(cls.call, "__recompute_grad_wrapped__")
    assert not hasattr(B.MultiHeadAttention.pay_attention_to, "__wrapped__")
    assert B.Dropout is tf.keras.layers.Dropout
    from bert4keras.backend import gelu_erf

    assert tf.keras.activations.get("gelu") is gelu_erf
    rb.patch()  # bert4keras is imported now: patched directly
    assert tf.keras.activations.get("gelu").__wrapped__ is gelu_erf
    for cls in rbp.marked_classes(B):
        assert hasattr(cls.call, "__recompute_grad_wrapped__")
    assert hasattr(B.MultiHeadAttention.pay_attention_to, "__wrapped__")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return str(tiny_bert.write_config(tmp_path_factory.mktemp("bert")))


def batch():
    rng = np.random.RandomState(0)
    token_ids = rng.randint(1, 100, size=(4, 12))
    token_ids[1, 7:] = 0  # padding: bert4keras masks it
    token_ids[3, 4:] = 0
    return token_ids, np.zeros_like(token_ids), np.array([0, 1, 1, 0])


# Dropout off here; with dropout on, see the tests at the end (replayable RNG).
def test_gradients_match_with_padding(config_path, monkeypatch, policy):
    calls = count_recomputed_calls(monkeypatch)
    token_ids, segment_ids, labels = batch()
    results = []
    for on in (False, True):
        model = tiny_bert.classifier(config_path)
        step = tiny_bert.loss_and_gradients(model, labels)
        with recompute.recompute_scope(on):
            for _ in range(2):
                loss_and_grads = step(token_ids, segment_ids)
        results.append(to_numpy(loss_and_grads))
    assert len(results[0]) == 1 + len(model.trainable_weights)
    assert_all_close(results[0], results[1])
    assert calls["n"] > 0  # the recomputation really ran


@pytest.mark.slow(seconds=18)  # tiny bert4keras fits, recompute off and on
def test_fit_matches(config_path, policy):
    token_ids, segment_ids, labels = batch()
    x = [np.tile(token_ids, (4, 1)), np.tile(segment_ids, (4, 1))]
    y = np.tile(labels, 4)
    weights = []
    for on in (False, True):
        model = tiny_bert.classifier(config_path)
        model.compile(tf.keras.optimizers.SGD(0.05), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights.append([np.asarray(w) for w in model.weights])
    assert_all_close(weights[0], weights[1])


def attention_layers(model):
    return [l for l in model.submodules if isinstance(l, B.MultiHeadAttention)]


def test_attention_dropout_is_one_sublayer_per_layer(dropout_config_path, replayable_rng):
    token_ids, segment_ids, _ = batch()
    model = tiny_bert.classifier(dropout_config_path)
    layers = attention_layers(model)
    assert len(layers) == 2
    first = [getattr(l, rbp.ATTENTION_DROPOUT_ATTR) for l in layers]
    assert all(isinstance(d, tf.keras.layers.Dropout) and d.rate == 0.1 for d in first)
    a = model([token_ids, segment_ids], training=True)
    b = model([token_ids, segment_ids], training=True)
    assert [getattr(l, rbp.ATTENTION_DROPOUT_ATTR) for l in layers] == first
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4  # dropout is on
    np.testing.assert_array_equal(model([token_ids, segment_ids]), model([token_ids, segment_ids]))


def test_default_patch_keeps_bert4keras_structure(config_path):
    names = [l.name for l in build_transformer_model(str(config_path)).layers]
    assert "Transformer-1-FeedForward-Norm" in names and "Transformer-1" not in names
    with pytest.raises(TypeError, match="`blocks` must be True or False. Received: blocks='yes'"):
        rb.patch(blocks="yes")
    with pytest.raises(ValueError, match="`policy` must be one of 'layer', 'block', 'attention', 'block_keep_ffn'. "
                                         "Received: policy='full'"):
        rb.patch(policy="full")
    with pytest.raises(ValueError, match="`blocks=True` means policy='block'"):
        rb.patch(policy="attention", blocks=True)
    rb.patch(policy="block", blocks=True)  # consistent: accepted
    rb.patch()


@pytest.mark.usefixtures("blocked_core")  # the blocked core: "auto" runs bert4keras's at seq 12
def test_dropout_on_gradients_match_eager(dropout_config_path, replayable_rng, monkeypatch, policy):
    calls = count_recomputed_calls(monkeypatch)
    cores = {"n": 0}
    real_core = _flash_tf.attention
    monkeypatch.setattr(_flash_tf, "attention",
                        lambda *a, **k: cores.__setitem__("n", cores["n"] + 1) or real_core(*a, **k))
    token_ids, segment_ids, labels = batch()
    results = []
    for on in (False, True):
        model = tiny_bert.classifier(dropout_config_path)
        step = tiny_bert.loss_and_gradients(model, labels)
        with recompute.recompute_scope(on):
            for _ in range(2):  # the second step draws new masks in both runs
                loss_and_grads = step(token_ids, segment_ids)
        results.append(to_numpy(loss_and_grads))
    assert all(g is not None for g in results[1])
    assert_all_close(results[0], results[1])
    # Each step: the two Transformer blocks (or their attention, feed-forward
    # and two layer norms) and the embedding layer norm; or, under "attention",
    # the five layer norms. The two attention cores run blocked (`_flash_tf.attention`,
    # the dropout's mask kept, not redrawn): once per step under "attention", twice
    # (forward pass and recomputation) under the others.
    assert calls["n"] == 2 * {"block": 2 + 1, "block_keep_ffn": 2 + 1, "layer": 2 * 4 + 1,
                              "attention": 2 * 2 + 1}[policy]
    assert cores["n"] == 2 * 2 * (1 if policy == "attention" else 2)


@pytest.mark.slow(seconds=25)  # tiny bert4keras fits with dropout, recompute off and on
@pytest.mark.usefixtures("blocked_core")  # the blocked core: "auto" runs bert4keras's at seq 12
def test_dropout_on_fit_matches(dropout_config_path, replayable_rng, policy):
    token_ids, segment_ids, labels = batch()
    x = [np.tile(token_ids, (4, 1)), np.tile(segment_ids, (4, 1))]
    y = np.tile(labels, 4)
    weights, losses = [], []
    for on in (False, True):
        model = tiny_bert.classifier(dropout_config_path)
        model.compile(tf.keras.optimizers.Adam(1e-3), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with recompute.recompute_scope(on):
            history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
        weights.append([np.asarray(w) for w in model.weights])
    # The losses follow weights updated with gradients that the FlashAttention-2 core
    # (and the GELU under "attention") compute by other ops: equal to rounding (the
    # first epoch's mean already holds its steps 2 to 4: 1 ulp apart since that core).
    assert_all_close(losses[0], losses[1], rtol=1e-6)
    assert_all_close(weights[0], weights[1])


def _step_graph(config_path, policy, on):
    """The graph of one training step of `tiny_bert.classifier(config_path)` built under `policy`,
    traced with recomputation `on`."""
    token_ids, segment_ids, labels = batch()
    rb.patch(policy=policy)
    try:
        model = tiny_bert.classifier(config_path)
    finally:
        rb.patch()

    @tf.function
    def step(token_ids, segment_ids):
        with tf.GradientTape() as tape:
            logits = model([token_ids, segment_ids], training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        return tape.gradient(loss, model.trainable_weights)

    with recompute.recompute_scope(on):
        return step.get_concrete_function(tf.constant(token_ids), tf.constant(segment_ids)).graph


def test_attention_policy_keeps_no_attention_matrix(dropout_config_path, replayable_rng):
    """Under policy="attention" the backward pass reads no [.., seq, seq] tensor of
    the forward pass; under "layer" with recomputation off it reads the softmax."""
    from tests.helpers.attention_blocks import forward_tensors_kept

    token_ids = batch()[0]
    kept = {}
    for policy, on in (("layer", False), ("attention", True)):
        kept[policy] = forward_tensors_kept(_step_graph(dropout_config_path, policy, on),
                                            token_ids.shape[1:] * 2)
    assert "Softmax" in kept["layer"], kept
    assert not kept["attention"], kept


def test_attention_policy_gelu_keeps_only_its_input(dropout_config_path, replayable_rng):
    """Under "attention" the FeedForward keeps one [seq, ffn] tensor (the GELU's input)
    for the gradient: no Erf output, no product, not the GELU's output (the second
    dense layer's input) is read by the backward pass; under "layer" with
    recomputation off, they are."""
    from tests.helpers.attention_blocks import forward_tensors_read_by_backward

    read = {}
    for policy, on in (("layer", False), ("attention", True)):
        tensors = forward_tensors_read_by_backward(_step_graph(dropout_config_path, policy, on))
        read[policy] = {t.op.type for t in tensors if "FeedForward" in t.op.name
                        and t.shape.rank in (2, 3) and t.shape[-1] == 64  # [batch, seq, ffn]
                        and t.op.type != "ReadVariableOp"}
    assert {"Erf", "AddV2", "Mul"} & read["layer"] or "RealDiv" in read["layer"], read
    assert "Reshape" in read["layer"], read  # the GELU's output, flattened for the matmul
    assert read["attention"] <= {"BiasAdd", "IdentityN", "Identity"}, read


def test_attention_policy_feed_forward_makes_its_input_again(dropout_config_path, replayable_rng):
    """Under "attention" the FeedForward's first dense layer does not keep its input (the
    LayerNormalization unit's output: `_feed_forward.remade_from_input`) for its kernel's
    gradient: the backward pass reads no FeedForward tensor of the hidden width (it
    makes the LayerNorm's output again from the unit's kept input); under "layer" with
    recomputation off it reads the input, flattened for the product."""
    from tests.helpers.attention_blocks import forward_tensors_read_by_backward

    read = {}
    for policy, on in (("layer", False), ("attention", True)):
        graph = _step_graph(dropout_config_path, policy, on)
        read[policy] = {t.op.name for t in forward_tensors_read_by_backward(graph)
                        if "-FeedForward/" in t.op.name and t.op.type == "Reshape"
                        and t.shape.rank == 2}
    assert read["layer"], read  # the input of the first product (and the GELU's output)
    assert not read["attention"], read


def test_attention_policy_attention_denses_make_their_input_again(dropout_config_path,
                                                                 replayable_rng):
    """Under "attention" the query, key and value `Dense` layers of an attention layer fed
    by a LayerNormalization unit (the second block's: the first is fed by the embeddings'
    dropout) do not keep that input for their kernels' gradients
    (`_feed_forward.dense_inputs_remade`): the backward pass reads one flattened input
    there (the output `Dense`'s, the core's output), where under "layer" with
    recomputation off it reads four; the first block's attention reads four under both."""
    from tests.helpers.attention_blocks import forward_tensors_read_by_backward

    read = {}
    for policy, on in (("layer", False), ("attention", True)):
        graph = _step_graph(dropout_config_path, policy, on)
        read[policy] = [sum(1 for t in forward_tensors_read_by_backward(graph)
                            if f"Transformer-{i}-MultiHeadSelfAttention/" in t.op.name
                            and t.op.type == "Reshape" and t.shape.rank == 2)
                        for i in (0, 1)]
    assert read == {"layer": [4, 4], "attention": [4, 1]}, read


def test_attention_policy_hidden_dropouts_keep_bits(dropout_config_path, replayable_rng):
    """Under "attention" the model's own `Dropout` layers (the embeddings' and each block's
    two, outside every patched class: `_patch._hidden_dropout`) keep their decisions as
    bits: the backward pass reads uint8 [batch, seq, hidden / 8], one per dropout, and no
    bool [batch, seq, hidden]; under "layer" with recomputation off it reads the bools."""
    from tests.helpers.attention_blocks import dropout_masks_read_by_backward as masks

    token_ids = batch()[0]
    hidden = tiny_bert.CONFIG["hidden_size"]
    dropouts = 1 + 2 * 2  # the embeddings', two per block
    assert masks(_step_graph(dropout_config_path, "attention", True)) == {
        ("uint8", (*token_ids.shape, hidden // 8)): dropouts}
    assert masks(_step_graph(dropout_config_path, "layer", False)) == {
        ("bool", (*token_ids.shape, hidden)): dropouts}


def test_attention_policy_recomputes_when_the_gradient_arrives(dropout_config_path, replayable_rng):
    """The GELU work redone in the backward pass (erf, the GELU output for the second
    dense layer) waits for the incoming gradient: a graph executor runs an op as
    soon as its inputs exist, so reading only forward tensors it would run during
    the forward pass and its outputs would wait in memory (measured: 455 instead
    of 224 MiB per sample kept at BERT-base, seq 512). The FeedForward's gradient runs
    its erf in a loop over chunks of rows (`recompute.ops._gelu.chunk_rows`): the loop
    waits then."""
    from tests.helpers.attention_blocks import _ops_with_bodies

    graph = _step_graph(dropout_config_path, "attention", True)
    ops = graph.get_operations()
    first = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
    backward = {op.name for op in ops[first:]}
    redone = [op for op in ops[first:]
              if any(o.type == "Erf" for o in _ops_with_bodies(graph, [op]))]
    assert redone
    for op in redone:
        seen, stack, gated = set(), [op], False
        while stack and not gated:
            node = stack.pop()
            for parent in [t.op for t in node.inputs] + list(node.control_inputs):
                if parent.name in seen:
                    continue
                seen.add(parent.name)
                gated = gated or (parent.name in backward and parent.name.startswith("gradient_tape/"))
                stack.append(parent)
        assert gated, f"{op.name} reads only forward tensors"


@pytest.mark.parametrize("policy", ["block", "block_keep_ffn"])
def test_block_keep_ffn_does_not_recompute_the_second_product(
        dropout_config_path, replayable_rng, monkeypatch, policy):
    """Under "block_keep_ffn" and "block" each FeedForward's product `gelu(h) @ kernel` is
    computed once per step, in the forward pass, and the loss and gradients equal
    RECOMPUTE=0's: the recomputed block takes it back under "block_keep_ffn", and needs
    no value of it under "block", whose last LayerNorm takes its gradient from the block's
    output (`_norm_from_output`; both run `_feed_forward.lean_call` inside the recomputed
    block)."""
    from recompute.bert4keras import _feed_forward

    products = []
    real = _feed_forward._matmul_last
    monkeypatch.setattr(_feed_forward, "_matmul_last",
                        lambda x, w, **k: products.append(bool(k)) or real(x, w, **k))
    rb.patch(policy=policy)
    try:
        results = [_loss_and_grads_counting(dropout_config_path, on, products, policy)
                   for on in (False, True)]
    finally:
        rb.patch()
    assert_all_close(results[0], results[1])


def _loss_and_grads_counting(config_path, on, products, policy):
    """One step's loss and gradients with recomputation `on`, checking the products counted."""
    token_ids, segment_ids, labels = batch()
    model = tiny_bert.classifier(config_path)
    products.clear()
    with recompute.recompute_scope(on):
        loss_and_grads = tiny_bert.loss_and_gradients(model, labels)(token_ids, segment_ids)
    if on:
        # 2 blocks: the forward products, 2 transposed products for the gradient
        assert products.count(False) == 2 and products.count(True) == 2, products
    else:
        assert products == []  # bert4keras's own FeedForward
    return to_numpy(loss_and_grads)
