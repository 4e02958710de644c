"""The registry of keras-hub's Transformer blocks that `patch()` recomputes: `BLOCKS`.

One row per block class of keras-hub 0.32 whose `call` is patched (a
subclass that inherits `call` is covered by its base's row: Whisper's
encoder and decoder, Llama3's decoder). Each row says

- `path`: where the class lives in keras-hub (a module path and a class
  name; a class missing from the installed keras-hub is skipped);
- `cache`: the arguments of `call` that carry a generation cache. A call
  that passes one of them, not None, decodes (`call_with_cache`,
  `generate`): it runs as keras-hub wrote it. Every other call trains and is
  recomputed (checked for every row: no backbone passes a cache in
  training -- except Gemma3n's KV-shared layers, whose blocks are not listed);
- `core`: what `policy="attention"` recomputes. `KERAS` for blocks whose
  attention layers are Keras `MultiHeadAttention`s with Keras's own core
  (`recompute_grad(policy="attention")` as for any Keras block: blocked
  core, GELU input kept); `(attention class path, core method)` pairs for the
  blocks whose attention layers compute attention in a method of their own
  (that method, called inside a training call, keeps only its inputs and
  runs again in the backward pass, its dropout replayed); `()` where no such
  method exists (the attention is computed inline in a layer's `call`):
  there `policy="attention"` recomputes the block in full and warns once.

Every row is checked on both backends by tests/helpers/keras_hub_decoder_checks.py
(a tiny backbone per class). `docs/keras_hub.md` lists every block class of
keras-hub 0.32: covered here, or why not (Gemma3n, Moonshine, the vision,
audio and diffusion blocks are not listed).
"""

import importlib
from typing import NamedTuple

KERAS = "keras"  # `core` of the blocks built on Keras's `MultiHeadAttention` core
_SRC = "keras_hub.src.models."


class Block(NamedTuple):
    path: str  # "keras_hub.src.<module>.<Class>"
    cache: tuple  # the arguments whose value (not None) means a decoding call
    core: object  # KERAS, ((attention class path, method), ...), or () (unreachable)


def _core(path, method="_compute_attention"):
    return ((_SRC + path, method),)


_LLAMA_CACHE = ("self_attention_cache",)

BLOCKS = (
    # Keras's MultiHeadAttention core
    Block("keras_hub.src.layers.modeling.transformer_encoder.TransformerEncoder", (), KERAS),
    Block("keras_hub.src.layers.modeling.transformer_decoder.TransformerDecoder",
          _LLAMA_CACHE, KERAS),
    Block(_SRC + "edrec.edrec_layers.EdRecEncoderBlock", (), KERAS),
    Block(_SRC + "edrec.edrec_layers.EdRecDecoderBlock", _LLAMA_CACHE, KERAS),
    # Gemma family: own cores
    Block(_SRC + "gemma.gemma_decoder_block.GemmaDecoderBlock", ("cache",),
          _core("gemma.gemma_attention.CachedGemmaAttention")),
    Block(_SRC + "pali_gemma.pali_gemma_decoder_block.PaliGemmaDecoderBlock", ("cache",),
          _core("gemma.gemma_attention.CachedGemmaAttention")),
    Block(_SRC + "gemma3.gemma3_decoder_block.Gemma3DecoderBlock", ("cache",),
          _core("gemma3.gemma3_attention.CachedGemma3Attention")),
    Block(_SRC + "gemma4.gemma4_decoder_block.Gemma4TextDecoderBlock", ("cache",),
          _core("gemma4.gemma4_attention.Gemma4TextAttention")),
    Block(_SRC + "t5gemma.t5gemma_encoder.T5GemmaEncoderLayer", (),
          _core("t5gemma.t5gemma_attention.T5GemmaAttention")),
    Block(_SRC + "t5gemma.t5gemma_decoder.T5GemmaDecoderLayer", ("cache",),
          _core("t5gemma.t5gemma_attention.T5GemmaAttention")),
    Block(_SRC + "t5gemma2.t5gemma2_encoder.T5Gemma2EncoderLayer", (),
          _core("t5gemma2.t5gemma2_attention.T5Gemma2Attention")),
    Block(_SRC + "t5gemma2.t5gemma2_decoder.T5Gemma2DecoderLayer", ("cache",),
          _core("t5gemma2.t5gemma2_attention.T5Gemma2Attention")
          + _core("t5gemma2.t5gemma2_attention.T5Gemma2MergedAttention")),
    # Llama-style decoders: own cores
    Block(_SRC + "llama.llama_decoder.LlamaTransformerDecoder", _LLAMA_CACHE,
          _core("llama.llama_attention.LlamaAttention")),
    Block(_SRC + "mistral.mistral_transformer_decoder.MistralTransformerDecoder", _LLAMA_CACHE,
          _core("mistral.mistral_attention.CachedMistralAttention")),
    Block(_SRC + "mixtral.mixtral_decoder.MixtralTransformerDecoder", _LLAMA_CACHE,
          _core("mixtral.mixtral_attention.CachedMixtralAttention")),
    Block(_SRC + "qwen.qwen_decoder.QwenTransformerDecoder", _LLAMA_CACHE,
          _core("qwen.qwen_attention.QwenAttention")),
    Block(_SRC + "qwen_moe.qwen_moe_decoder.QwenMoeTransformerDecoder", _LLAMA_CACHE,
          _core("qwen_moe.qwen_moe_attention.QwenMoeAttention")),
    Block(_SRC + "qwen3.qwen3_decoder.Qwen3TransformerDecoder", _LLAMA_CACHE,
          _core("qwen3.qwen3_attention.Qwen3Attention")),
    Block(_SRC + "qwen3_moe.qwen3_moe_decoder.Qwen3MoeTransformerDecoder", _LLAMA_CACHE,
          _core("qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention")),
    Block(_SRC + "qwen3_5.qwen3_5_decoder.Qwen3_5TransformerDecoder", _LLAMA_CACHE,
          _core("qwen3_5.qwen3_5_attention.Qwen3_5Attention")),
    Block(_SRC + "qwen3_5_moe.qwen3_5_moe_decoder.Qwen3_5MoeTransformerDecoder", _LLAMA_CACHE,
          _core("qwen3_5.qwen3_5_attention.Qwen3_5Attention")),
    Block(_SRC + "phi3.phi3_decoder.Phi3Decoder", ("attention_cache",),
          _core("phi3.phi3_attention.Phi3Attention")),
    Block(_SRC + "gpt_neo_x.gpt_neo_x_decoder.GPTNeoXDecoder", _LLAMA_CACHE,
          _core("gpt_neo_x.gpt_neo_x_attention.GPTNeoXAttention")),
    Block(_SRC + "gpt_oss.gpt_oss_decoder.GptOssTransformerDecoder", _LLAMA_CACHE,
          _core("gpt_oss.gpt_oss_attention.GptOssAttention")),
    Block(_SRC + "smollm3.smollm3_layers.SmolLM3DecoderLayer", _LLAMA_CACHE,
          _core("smollm3.smollm3_layers.SmolLM3Attention")),
    # Encoders with own cores
    Block(_SRC + "deberta_v3.disentangled_attention_encoder.DisentangledAttentionEncoder", (),
          _core("deberta_v3.disentangled_self_attention.DisentangledSelfAttention")),
    Block(_SRC + "xlnet.xlnet_encoder.XLNetEncoder", (),
          _core("xlnet.relative_attention.TwoStreamRelativeAttention", "compute_attention")),
    # attention computed inline: policy="attention" recomputes these in full
    Block(_SRC + "bloom.bloom_decoder.BloomDecoder", ("cache",), ()),
    Block(_SRC + "falcon.falcon_transformer_decoder.FalconTransformerDecoder",
          ("attention_cache",), ()),
    Block(_SRC + "t5.t5_transformer_layer.T5TransformerLayer", _LLAMA_CACHE, ()),
    Block(_SRC + "esm.esm_encoder.ESMEncoder", (), ()),
    Block(_SRC + "roformer_v2.roformer_v2_encoder.RoformerV2Encoder", (), ()),
)


def load(path):
    """The class at `path` ("package.module.Class") in the installed keras-hub, or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def installed():
    """(class, its `Block` row) for each row whose class the installed keras-hub has."""
    found = []
    for row in BLOCKS:
        cls = load(row.path)
        if cls is not None:
            found.append((cls, row))
    return found


def cores(row):
    """The (attention class, core method name) pairs of `row` the installed keras-hub has."""
    if row.core == KERAS:
        return ()
    return tuple((cls, method) for cls, method in ((load(p), m) for p, m in row.core)
                 if cls is not None and method in vars(cls))
