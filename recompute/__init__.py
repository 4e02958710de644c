"""Exact-gradient activation recomputation (gradient checkpointing) for Keras.

```python
from recompute import recompute_grad

class Block(keras.layers.Layer):
    @recompute_grad
    def call(self, x, training=None):
        ...
```

Set `RECOMPUTE=1` (read when the layer runs) or use `recompute_scope(True)`.
`@recompute_grad(policy="attention")` recomputes only the attention
probabilities of the block's `MultiHeadAttention` layers (`POLICIES`). Under
every policy the attention cores follow one rule (`attention_core`,
`_flash.runs_blocked`): on TensorFlow in float32 beyond 512 keys they run
blocked (no [seq, seq] floats kept, one block of query rows alive at a time:
`attention_block_size` sets it); up to 512 keys on TensorFlow (faster there,
at about the same memory), on JAX and in half precision the layer's own core runs,
recomputed.

Modules: `_decorator` (the decorator), `_policies` (what is recomputed: one
registry, `POLICIES`, of each policy's TensorFlow and JAX functions), `_core`
(the recomputation, `Recomputation`: forward, backward, unpack through one
`tf.custom_gradient`), `_flash` (the blocked attention algorithm, once) with
its engines `_flash_tf` and `_flash_jax`, `_attention` (Keras's attention core
as the blocked core, its dropout drawn once and kept as bits), `_gelu` (a GELU
that keeps only its input: a custom gradient, or `jax.checkpoint` on JAX),
`_adapter` (the interface to a Keras family) with
`_keras3` and `_tf_keras` (its two implementations) chosen by `_backends`. Every
private Keras or TensorFlow name is read in one of the interface modules that list
them in their `PRIVATE_NAMES` (checked against the installed versions by the
`test_private_interface*` tests): `_keras_private` (Keras 3's, for `_keras3`,
`_jax`, `_flash_jax`, `_gelu`, `_backends` and `keras_hub`), `_mha_private`
(`MultiHeadAttention`'s, both families: `_attention`), `_tf_keras` (tf_keras's),
`_tf` (TensorFlow internals) and `keras_hub._private` (`chunked_loss`'s);
`planner` reads TensorFlow's `device_lib` itself. `_config` (the
switch), `_errors`, `_precision` (`exact_float32`: float32 products on GPUs,
where TF32 is the default), `_setting` (what `exact_float32` and
`attention_block_size` and `attention_core` share: a statement or a context manager that
restores, on exit, what its entry found); `_jax` (Keras 3's JAX backend: the call as a
`jax.checkpoint`, state threaded through, and its policies' functions);
`_hf_checkpoint` (a Hugging Face BERT's files, read by both integrations);
`recompute.bert4keras` (bert4keras integration and checkpoint converter);
`recompute.keras_hub` (keras-hub's `TransformerEncoder`, offline presets);
`planner` (`plan`: the policy, micro-batch and accumulation steps of an
effective batch within a memory budget, measured; its command is
`python -m recompute.planner` -- the module is not named `plan`, so that
importing it never rebinds the function `recompute.plan`), with `_xla_plan`
(XLA's plan of Keras's jitted JAX `train_step` for the local device or a GPU
described by its facts: the cards, the compilation for a target;
`benchmarks.gpu_plan` uses it too).
"""

from ._config import ENV_VAR, is_enabled, recompute_scope
from ._errors import VariableCreatedInRecomputationError
from ._flash import attention_block_size, attention_core
from ._decorator import recompute_grad
from ._policies import NAMES as POLICIES  # the names `recompute_grad(policy=...)` takes
from ._precision import exact_float32

__all__ = [
    "ENV_VAR",
    "POLICIES",
    "Plan",
    "VariableCreatedInRecomputationError",
    "attention_block_size",
    "attention_core",
    "exact_float32",
    "is_enabled",
    "plan",
    "recompute_grad",
    "recompute_scope",
]
__version__ = "0.1.0"


def __getattr__(name):
    # `plan` and `Plan` load `planner` on first use: `python -m recompute.planner` then runs a
    # module the package has not imported yet (runpy warns otherwise).
    if name in ("plan", "Plan"):
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'recompute' has no attribute {name!r}")
