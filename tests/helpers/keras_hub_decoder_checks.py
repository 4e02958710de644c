"""Checks of `recompute.keras_hub.patch()` over every block class it covers (`_blocks.BLOCKS`),
run on Keras's TensorFlow backend (tests/recompute_keras3/test_keras_hub_blocks.py) and on
JAX (tests/recompute_jax/test_keras_hub_blocks_jax.py), which import the `test_*` functions
(`__all__`).

Per block class (on JAX one class of each kind of attention core, `FAST_BLOCKS`; decoding
with GPT-2 and Gemma), a tiny backbone built from it (hidden 16, 2 blocks, dropout 0.1 where the
backbone has dropout, padded tails in every padding mask) gives with RECOMPUTE on, under
each policy, the loss, every gradient (≤ 1e-5) and the random state of RECOMPUTE=0
unpatched; and the recomputation is counted, so that a patch that recomputes nothing fails:
on TensorFlow the recomputed calls (`recompute.engine._core.Recomputation._recompute`, and the
blocked Keras cores' backward passes, `recompute.ops._flash.backward`), on JAX the
`jax.checkpoint` and `custom_vjp` equations of the gradient's jaxpr. Gradients: a
`GradientTape` in eager mode on TensorFlow; on JAX `jax.value_and_grad` of
`stateless_call`, eager (the tiny ops' kernels, compiled once, serve every test: jitting
each step costs seconds of compilation).
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest

from recompute import recompute_scope
from tests.helpers.numerics import assert_all_close

V, SEQ, BATCH = 40, 8, 2
M = "keras_hub.models."


def _m(name):
    import keras_hub

    return getattr(keras_hub.models, name)


def _llama_like(name, **extra):
    return lambda: _m(name)(vocabulary_size=V, num_layers=2, num_query_heads=2,
                            num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                            dropout=0.1, **extra)


# block class (as `_blocks.BLOCKS` names it, without "keras_hub.src.") -> tiny backbone
BACKBONES = {
    "layers.modeling.transformer_encoder.TransformerEncoder": lambda: _m("BertBackbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1),
    "layers.modeling.transformer_decoder.TransformerDecoder": lambda: _m("GPT2Backbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1),
    "models.gemma.gemma_decoder_block.GemmaDecoderBlock": lambda: _m("GemmaBackbone")(
        vocabulary_size=V, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=0.1),
    "models.gemma3.gemma3_decoder_block.Gemma3DecoderBlock": lambda: _m("Gemma3Backbone")(
        vocabulary_size=V, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
        vision_encoder=None, dropout=0.1),
    "models.llama.llama_decoder.LlamaTransformerDecoder": _llama_like("LlamaBackbone"),
    "models.mistral.mistral_transformer_decoder.MistralTransformerDecoder":
        _llama_like("MistralBackbone"),
    "models.mixtral.mixtral_decoder.MixtralTransformerDecoder":
        _llama_like("MixtralBackbone", num_experts=2),
    "models.qwen.qwen_decoder.QwenTransformerDecoder": _llama_like("QwenBackbone"),
    "models.qwen_moe.qwen_moe_decoder.QwenMoeTransformerDecoder": _llama_like(
        "QwenMoeBackbone", moe_intermediate_dim=16, shared_expert_intermediate_dim=16,
        num_experts=2, top_k=1),
    "models.qwen3.qwen3_decoder.Qwen3TransformerDecoder": _llama_like("Qwen3Backbone", head_dim=8),
    "models.qwen3_moe.qwen3_moe_decoder.Qwen3MoeTransformerDecoder": _llama_like(
        "Qwen3MoeBackbone", head_dim=8, moe_intermediate_dim=16, num_experts=2, top_k=1),
    "models.phi3.phi3_decoder.Phi3Decoder": _llama_like("Phi3Backbone"),
    "models.gpt_neo_x.gpt_neo_x_decoder.GPTNeoXDecoder": lambda: _m("GPTNeoXBackbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1),
    "models.smollm3.smollm3_layers.SmolLM3DecoderLayer": lambda: _m("SmolLM3Backbone")(
        vocabulary_size=V, hidden_dim=16, intermediate_dim=32, num_layers=2,
        num_attention_heads=2, num_key_value_heads=1, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[True, False],
        layer_types=["attention", "attention"], mlp_bias=False, layer_norm_epsilon=1e-6,
        max_position_embeddings=32, rope_theta=10000.0, partial_rotary_factor=1.0),
    "models.deberta_v3.disentangled_attention_encoder.DisentangledAttentionEncoder":
        lambda: _m("DebertaV3Backbone")(vocabulary_size=V, num_layers=2, num_heads=2,
                                         hidden_dim=16, intermediate_dim=32,
                                         max_sequence_length=SEQ, bucket_size=4, dropout=0.1),
    "models.bloom.bloom_decoder.BloomDecoder": lambda: _m("BloomBackbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.1),
    "models.falcon.falcon_transformer_decoder.FalconTransformerDecoder": lambda: _m(
        "FalconBackbone")(vocabulary_size=V, num_layers=2, num_attention_heads=2, hidden_dim=16,
                          intermediate_dim=32, attention_dropout_rate=0.1,
                          feedforward_dropout_rate=0.1),
    "models.t5.t5_transformer_layer.T5TransformerLayer": lambda: _m("T5Backbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        key_value_dim=8, dropout=0.1),
    "models.qwen3_5.qwen3_5_decoder.Qwen3_5TransformerDecoder": lambda: _m("Qwen3_5Backbone")(
        vocabulary_size=V, num_layers=2, num_query_heads=2, num_key_value_heads=1, head_dim=8,
        hidden_dim=16, intermediate_dim=32, layer_types=["full_attention", "full_attention"],
        dropout=0.1),
    "models.qwen3_5_moe.qwen3_5_moe_decoder.Qwen3_5MoeTransformerDecoder": lambda: _m(
        "Qwen3_5MoeBackbone")(vocabulary_size=V, num_layers=2, num_query_heads=2,
                              num_key_value_heads=1, head_dim=8, hidden_dim=16,
                              moe_intermediate_dim=16, shared_expert_intermediate_size=16,
                              num_experts=2, top_k=1,
                              layer_types=["full_attention", "full_attention"], dropout=0.1),
    "models.gpt_oss.gpt_oss_decoder.GptOssTransformerDecoder": lambda: _m("GptOssBackbone")(
        vocabulary_size=V, num_layers=2, num_query_heads=2, hidden_dim=16, intermediate_dim=32,
        num_key_value_heads=1, num_experts=2, top_k=1, head_dim=8, dropout=0.1),
    "models.gemma4.gemma4_decoder_block.Gemma4TextDecoderBlock": lambda: _m("Gemma4Backbone")(
        vocabulary_size=V, image_size=16, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=0.1),
    "models.pali_gemma.pali_gemma_decoder_block.PaliGemmaDecoderBlock": lambda: _m(
        "PaliGemmaBackbone")(vocabulary_size=V, image_size=16, num_layers=2, num_query_heads=2,
                             num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                             head_dim=8, vit_patch_size=8, vit_num_heads=2, vit_hidden_dim=16,
                             vit_num_layers=1, dropout=0.1),
    "models.t5gemma.t5gemma_encoder.T5GemmaEncoderLayer": lambda: _t5gemma("T5GemmaBackbone"),
    "models.t5gemma.t5gemma_decoder.T5GemmaDecoderLayer": lambda: _t5gemma("T5GemmaBackbone"),
    "models.t5gemma2.t5gemma2_encoder.T5Gemma2EncoderLayer": lambda: _t5gemma("T5Gemma2Backbone"),
    "models.t5gemma2.t5gemma2_decoder.T5Gemma2DecoderLayer": lambda: _t5gemma("T5Gemma2Backbone"),
    "models.xlnet.xlnet_encoder.XLNetEncoder": lambda: _m("XLNetBackbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.1),
    "models.esm.esm_encoder.ESMEncoder": lambda: _m("ESMBackbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.1, max_sequence_length=SEQ),
    "models.roformer_v2.roformer_v2_encoder.RoformerV2Encoder": lambda: _m("RoformerV2Backbone")(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        head_size=8, dropout=0.1),
    "models.edrec.edrec_layers.EdRecEncoderBlock": lambda: _edrec(),
    "models.edrec.edrec_layers.EdRecDecoderBlock": lambda: _edrec(),
}


def _t5gemma(name):
    half = dict(hidden_dim=16, intermediate_dim=32, num_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, layer_types=["full_attention"] * 2)
    kwargs = {f"{part}_{k}": v for part in ("encoder", "decoder") for k, v in half.items()}
    return _m(name)(vocabulary_size=V, dropout_rate=0.1, attention_dropout=0.1, **kwargs)


def _edrec():
    return _m("EdRecBackbone")(vocab_size=V, num_layers_enc=2, num_layers_dec=2, hidden_dim=16,
                               intermediate_dim=32, num_heads=2, dropout=0.1)


BLOCK_NAMES = list(BACKBONES)
SHORT = {name: name.rpartition(".")[2] for name in BLOCK_NAMES}


def _row(name):
    from recompute.keras_hub import _blocks

    return next(row for row in _blocks.BLOCKS if row.path == "keras_hub.src." + name)


def batch(backbone, seed=1):
    """Inputs for every input of the functional `backbone`: token ids in [1, V), padding
    masks with padded tails of different lengths, segment ids 0/1, other floats normal."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(SEQ // 2, SEQ, BATCH).astype(int)
    tails = np.arange(SEQ)[None, :] < lengths[:, None]
    x = {}
    for tensor in keras.tree.flatten(backbone.input):
        name = tensor.name
        shape = [BATCH] + [SEQ if d is None else d for d in tensor.shape[1:]]
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "position" in name:
            x[name] = np.broadcast_to(np.arange(SEQ), shape).astype(dtype)
        elif "mask" in name:
            x[name] = tails.astype(dtype)
        elif "segment" in name:
            x[name] = (np.arange(SEQ)[None, :] >= SEQ // 2).astype(dtype) * tails
        elif "int" in dtype:
            x[name] = np.where(tails, rng.integers(1, V, size=shape), 0).astype(dtype)
        else:
            x[name] = rng.normal(size=shape).astype(dtype)
    return x


def _loss(outputs, losses):
    """A small head on every float output: the mean of (output - 0.5)², plus the added losses."""
    from keras import ops

    total = 0.0
    for out in keras.tree.flatten(outputs):
        if "float" in keras.backend.standardize_dtype(out.dtype):
            total = total + ops.mean(ops.square(out - 0.5))
    for loss in losses:
        total = total + loss
    return total


@contextlib.contextmanager
def _tf_recomputations():
    """Counts what the TensorFlow engine recomputes while active: {"calls": [the layers of
    each recomputed call], "cores": blocked Keras cores run backward}."""
    from recompute.engine import _core
    from recompute.ops import _flash

    seen = {"calls": [], "cores": 0}
    recompute, backward = _core.Recomputation._recompute, _flash.backward

    def counted_recompute(self, *args, **kwargs):
        seen["calls"].append(self.layer)
        return recompute(self, *args, **kwargs)

    def counted_backward(*args, **kwargs):
        seen["cores"] += 1
        return backward(*args, **kwargs)

    _core.Recomputation._recompute, _flash.backward = counted_recompute, counted_backward
    try:
        yield seen
    finally:
        _core.Recomputation._recompute, _flash.backward = recompute, backward


def _tf_step(backbone, x, on):
    import tensorflow as tf

    start = [v.numpy() for v in backbone.variables]
    with _tf_recomputations() as seen:
        with recompute_scope(on), tf.GradientTape() as tape:
            out = backbone(x, training=True)
            loss = _loss(out, backbone.losses)
        grads = tape.gradient(loss, backbone.trainable_variables)
    grads = [None if g is None else np.asarray(tf.convert_to_tensor(g)) for g in grads]
    state = [np.asarray(v.numpy()) for v in backbone.non_trainable_variables]
    for v, value in zip(backbone.variables, start):
        v.assign(value)
    return float(loss), grads, state, len(seen["calls"]) + seen["cores"]


def _jax_primitives(jaxpr, names):
    """The number of equations of `jaxpr` (nested ones included) whose primitive is in `names`
    or starts with one of them."""
    from tests.helpers.jax_backend import jaxprs

    return sum(eqn.primitive.name.startswith(names) for inner in jaxprs(jaxpr) for eqn in inner.eqns)


def _jax_step(backbone, x, on):
    import jax

    trainable = [v.value for v in backbone.trainable_variables]
    non_trainable = [v.value for v in backbone.non_trainable_variables]

    def loss_fn(values):
        out, state, losses = backbone.stateless_call(values, non_trainable, x, training=True,
                                                     return_losses=True)
        return _loss(out, losses), state

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    with recompute_scope(on):
        with _recomputed_calls() as traced:  # the blocked cores' custom_vjp are differentiated
            jaxpr = jax.make_jaxpr(grad_fn)(trainable)  # away in the jaxpr: counted as traced
        # Eager, not jitted: the tiny ops' compiled kernels are shared by every test.
        (loss, state), grads = grad_fn(trainable)
    recomputed = max(traced[0], _jax_primitives(jaxpr.jaxpr, ("remat", "checkpoint", "custom_vjp")))
    return (float(loss), [np.asarray(g) for g in grads], [np.asarray(s) for s in state],
            recomputed)


def step(backbone, x, on):
    """(loss, gradient of each trainable variable, non-trainable values after, the number of
    recomputed units) of one training step from the backbone's state, which it leaves as is."""
    if keras.backend.backend() == "jax":
        return _jax_step(backbone, x, on)
    return _tf_step(backbone, x, on)


def _check_same(reference, got, backbone, what):
    loss0, grads0, state0, _ = reference
    loss1, grads1, state1, _ = got
    names = [v.path for v in backbone.trainable_variables]
    missing = [n for n, a, b in zip(names, grads0, grads1) if (a is None) != (b is None)]
    assert not missing, f"{what}: None gradients differ: {missing}"
    kept = [i for i, g in enumerate(grads0) if g is not None]
    assert_all_close([np.array(loss0)] + [grads0[i] for i in kept],
                     [np.array(loss1)] + [grads1[i] for i in kept],
                     [f"{what}: loss"] + [f"{what}: {names[i]}" for i in kept])
    for a, b in zip(state0, state1):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: random state")


# One block of each kind of attention core: Keras's (BERT's encoder, GPT-2's decoder), an
# own core (Gemma, Llama) and inline (Bloom). On TensorFlow every block class is tested, the
# others marked slow; on JAX, where each case costs tens of seconds of eager dispatch on a
# CPU, these only: the patch and its per-class adapters are the same code on both backends,
# the recomputation is the backend's (one of each kind covers it).
FAST_BLOCKS = ("TransformerEncoder", "TransformerDecoder", "GemmaDecoderBlock",
               "LlamaTransformerDecoder", "BloomDecoder")
FAST_CAUSAL_LMS = ("GPT2CausalLM", "GemmaCausalLM")  # decoding: Keras's core and an own core
EVERY_CLASS = keras.backend.backend() != "jax"


@pytest.mark.parametrize("name", [
    pytest.param(n, id=SHORT[n], marks=() if SHORT[n] in FAST_BLOCKS else pytest.mark.slow)
    for n in BLOCK_NAMES if EVERY_CLASS or SHORT[n] in FAST_BLOCKS
])
def test_block_recomputes_exactly(name):
    """A tiny backbone of the block: RECOMPUTE=1 under both policies gives RECOMPUTE=0's loss,
    gradients and random state (unpatched), and recomputes at least once per block."""
    import recompute.keras_hub as hub
    from recompute.keras_hub import _blocks, _patch

    keras.utils.set_random_seed(0)
    backbone = BACKBONES[name]()
    cls = _blocks.load("keras_hub.src." + name)
    blocks = [layer for layer in backbone._flatten_layers() if isinstance(layer, cls)]
    assert len(blocks) >= 2, name
    x = batch(backbone)
    reference = step(backbone, x, on=False)
    assert reference[3] == 0
    row = _row(name)
    try:
        for policy in ("full", "attention"):
            hub.patch(policy)
            assert set(blocks) <= set(hub.covered(backbone))
            full_instead = policy == "attention" and row.core == ()
            _patch._warned.discard(cls)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = step(backbone, x, on=True)
            said = [w for w in caught if cls.__name__ in str(w.message)]
            assert len(said) == full_instead, [str(w.message) for w in caught]
            _check_same(reference, got, backbone, policy)
            assert got[3] >= len(blocks), (policy, got[3])
            again = step(backbone, x, on=False)  # patched, RECOMPUTE off: as written
            _check_same(reference, again, backbone, f"{policy}, off")
            assert again[3] == 0
    finally:
        hub.unpatch()


# block class -> the CausalLM task that decodes with it (`_build_cache`, `call_with_cache`)
CAUSAL_LMS = {
    "layers.modeling.transformer_decoder.TransformerDecoder": "GPT2CausalLM",
    "models.gemma.gemma_decoder_block.GemmaDecoderBlock": "GemmaCausalLM",
    "models.llama.llama_decoder.LlamaTransformerDecoder": "LlamaCausalLM",
    "models.phi3.phi3_decoder.Phi3Decoder": "Phi3CausalLM",
    "models.smollm3.smollm3_layers.SmolLM3DecoderLayer": "SmolLM3CausalLM",
    "models.bloom.bloom_decoder.BloomDecoder": "BloomCausalLM",
    "models.falcon.falcon_transformer_decoder.FalconTransformerDecoder": "FalconCausalLM",
    "models.mixtral.mixtral_decoder.MixtralTransformerDecoder": "MixtralCausalLM",
}


@contextlib.contextmanager
def _recomputed_calls():
    """Counts the calls that start a recomputation, on either engine, or run a Keras core
    blocked (policy="attention" of Keras's `MultiHeadAttention` cores), while active."""
    from recompute.ops import _attention
    from recompute.engine import _core
    from recompute.engine import _jax

    count = [0]
    originals = _core.recomputed_call, _jax.recomputed_call, _attention.keras_blocked

    def counted(original):
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            count[0] += result is not None  # a Keras core not blocked returns None
            return result
        return call

    _core.recomputed_call, _jax.recomputed_call, _attention.keras_blocked = (
        counted(f) for f in originals)
    try:
        yield count
    finally:
        _core.recomputed_call, _jax.recomputed_call, _attention.keras_blocked = originals


def _decode(causal_lm, ids):
    """The prefill (`_build_cache`) and one `call_with_cache` step: their logits and caches."""
    out = causal_lm._build_cache(ids)
    cache = out[-1]
    index = keras.ops.convert_to_tensor(2, "int32")  # a tensor, as `generate` passes it
    logits, hidden, cache = causal_lm.call_with_cache(ids[:, :1], cache, index)
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in keras.tree.flatten((out, logits, cache))]


@pytest.mark.parametrize("name", [
    pytest.param(n, id=SHORT[n], marks=() if CAUSAL_LMS[n] in FAST_CAUSAL_LMS else pytest.mark.slow)
    for n in CAUSAL_LMS if EVERY_CLASS or CAUSAL_LMS[n] in FAST_CAUSAL_LMS
])
def test_decoding_runs_as_written(name):
    """Patched, RECOMPUTE on and (TensorFlow) a tape recording: the prefill and a decoding
    step of a CausalLM start no recomputation and give the unpatched logits and caches."""
    import recompute.keras_hub as hub

    keras.utils.set_random_seed(0)
    causal_lm = _m(CAUSAL_LMS[name])(backbone=BACKBONES[name](), preprocessor=None)
    ids = batch(causal_lm.backbone)["token_ids"]
    reference = _decode(causal_lm, ids)
    tape = contextlib.nullcontext()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tape = tf.GradientTape()
    try:
        for policy in ("full", "attention"):
            hub.patch(policy)
            with _recomputed_calls() as count, recompute_scope(True), tape, \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # policy="attention" on Bloom, Falcon: full
                got = _decode(causal_lm, ids)
            assert count[0] == 0, (policy, count[0])
            for a, b in zip(reference, got):
                np.testing.assert_array_equal(a, b)
            # The same block, training: recomputed (so the count above can fail).
            with _recomputed_calls() as count, recompute_scope(True), tape:
                causal_lm.backbone(batch(causal_lm.backbone), training=True)
            assert count[0] >= 2, (policy, count[0])
    finally:
        hub.unpatch()


def test_patch_switches_policy_and_unpatch_restores_every_class():
    """`patch()` replaces the `call` of every installed block class (with its policy);
    `patch` with another policy switches; `unpatch()` restores keras-hub's own `call`."""
    import recompute.keras_hub as hub
    from recompute.keras_hub import _blocks, _patch

    classes = _blocks.installed()
    assert len(classes) == len(_blocks.BLOCKS)  # keras-hub 0.32 has every listed class
    assert {row.path for _, row in classes} == {"keras_hub.src." + n for n in BLOCK_NAMES}
    own = {cls: cls.__dict__["call"] for cls, _ in classes}
    with pytest.raises(ValueError, match="Received: policy='block'"):
        hub.patch("block")
    try:
        for policy in ("full", "attention", "attention"):
            hub.patch(policy)
            assert hub.is_patched() == policy
            for cls, _ in classes:
                call = cls.__dict__["call"]
                assert getattr(call, _patch._MARK) == policy, cls
                assert call.__recompute_grad_wrapped__ is own[cls]
    finally:
        hub.unpatch()
    assert hub.is_patched() is None
    assert all(cls.__dict__["call"] is own[cls] for cls, _ in classes)
    hub.unpatch()  # nothing to undo


def test_covered_warns_when_nothing_recomputes():
    """`covered(model)` lists nothing and warns, naming why: keras-hub not patched, or a
    model with no block the registry covers."""
    import recompute.keras_hub as hub

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="plain")
    with pytest.warns(UserWarning, match="'plain' has no block.*not patched"):
        assert hub.covered(model) == []
    hub.patch()
    try:
        with pytest.warns(UserWarning, match="'plain' has no block.*none of its layers"):
            assert hub.covered(model) == []
    finally:
        hub.unpatch()


# what the suites import
__all__ = [name for name in dir() if name.startswith("test_")]
