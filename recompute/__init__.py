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
`recompute.ops._flash.runs_blocked`): on TensorFlow in float32 beyond 512 keys they run
blocked (no [seq, seq] floats kept, one block of query rows alive at a time:
`attention_block_size` sets it); up to 512 keys on TensorFlow, under
`"attention"` the blocked core as one block of every row, under `"full"` the layer's
own core (faster there, at about the same memory); in half precision the layer's own
core runs, recomputed; on JAX in float32 the blocked core.

Packages, from the top floor down: `planner` (`plan`: the policy, micro-batch and
accumulation steps of an effective batch within a memory budget, measured; its command
is `python -m recompute.planner` -- the module is not named `plan`, so that importing it
never rebinds the function `recompute.plan`) with `_xla_plan` (XLA's plan of Keras's
jitted JAX `train_step` for the local device or a GPU described by its facts;
`benchmarks.gpu_plan` uses it too); the integrations `recompute.bert4keras` (bert4keras
and its checkpoint converter) and `recompute.keras_hub` (keras-hub's blocks, LoRA, the
chunked LM head, offline presets), with `_hf_checkpoint` (a Hugging Face BERT's files,
read by both); `_decorator` (the decorator: it asks the engine of the layer's family,
`recompute.engine.of`, whether a call is recomputed and has it run the policy's
function); `recompute.policies` (what is recomputed: the registry `POLICIES` of each
policy's TensorFlow and JAX functions); `recompute.ops` (what a
recomputed block runs differently: the FlashAttention-2 core, once, with its TensorFlow
and JAX engines and the rule that picks it; Keras's attention core as that core; a GELU
and a LayerNorm that keep only their input, and the `Dense` layers they feed, under
`"attention"` on TensorFlow; under `"full"` on JAX a feed-forward pair of `Dense` layers whose
gradient runs in row blocks); `recompute.engine` (the recomputation, behind one interface: on TensorFlow one
`tf.custom_gradient`, forward, backward, unpack; on JAX a `jax.checkpoint` with the
layer's state threaded through, or under `"full"` a block's batch run in cuts -- on
TensorFlow too, `engine._cuts_tf` -- whose size `engine._batch_cut`'s `batch_cut` sets; one
tracker of the running calls for both);
`recompute.adapters` (the interface to
a Keras family with its Keras 3 and tf_keras implementations, and the interface modules
that read every private Keras or TensorFlow name, each listing them in its
`PRIVATE_NAMES`, checked against the installed versions by the
`test_private_interface*` tests; `keras_hub._private` lists `chunked_loss`'s). Beside them: `_config` (the switch),
`_errors`, `_scoped` (a per-thread stack of what a thread is inside of, and instance
attributes shadowed for a block: written once for every module), `_precision` (`exact_float32`: float32 products on GPUs, where TF32 is the
default), `_setting` (what `exact_float32`, `attention_block_size`,
`attention_core` and `batch_cut` share: a statement or a context manager that restores,
on exit, what its entry found).
"""

from ._config import ENV_VAR, is_enabled, recompute_scope
from ._errors import VariableCreatedInRecomputationError
from .ops._flash import attention_block_size, attention_core
from .engine._batch_cut import batch_cut
from ._decorator import recompute_grad
from .policies._registry import NAMES as POLICIES  # the names `recompute_grad(policy=...)` takes
from ._precision import exact_float32

__all__ = [
    "ENV_VAR",
    "POLICIES",
    "Plan",
    "VariableCreatedInRecomputationError",
    "attention_block_size",
    "attention_core",
    "batch_cut",
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
