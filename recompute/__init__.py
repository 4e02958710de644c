"""Exact-gradient activation recomputation (gradient checkpointing) for Keras.

```python
from recompute import recompute_grad

class Block(keras.layers.Layer):
    @recompute_grad
    def call(self, x, training=None):
        ...
```

Set `RECOMPUTE=1` (read when the layer runs) or use `recompute_scope(True)`.
"""

from ._config import ENV_VAR, is_enabled, recompute_scope
from ._errors import VariableCreatedInRecomputationError
from ._decorator import recompute_grad

__all__ = [
    "ENV_VAR",
    "VariableCreatedInRecomputationError",
    "is_enabled",
    "recompute_grad",
    "recompute_scope",
]
__version__ = "0.1.0"
