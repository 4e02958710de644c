"""Exact gradient accumulation for Keras 3 and tf_keras.

```python
from accum import AccumOptimizer

model.compile(optimizer=AccumOptimizer(keras.optimizers.Adam(), steps_per_update=8), ...)
model.fit(x, y, batch_size=4)       # trains like batch_size=32
```

Under `tf.distribute.MirroredStrategy` or `MultiWorkerMirroredStrategy`, build
the model and the optimizer in `strategy.scope()`; each replica accumulates
locally and the replicas all-reduce once per update, not once per micro-batch
(`accum.modes._distributed`; `python -m benchmarks.accum_distribute` measures it).
On JAX under `keras.distribution`, `accum.local_gradients(model)` does the same
(`accum.keras3._local_jax`; `python -m benchmarks.accum_local_jax`).

Where things are (each package's `__init__` maps its own modules):

| | |
|---|---|
| the public class; `WrapperOps`, the operations of `modes._family.Family` every family reads off its wrapper alike; argument checks | `_base` (`AccumOptimizer`, `WrapperOps`); `_validation` |
| which family an optimizer is (by its class hierarchy; Keras 3's base class is its one private name, in its `PRIVATE_NAMES`); which class serves it (linked to the public classes, and registered for loading, by this module) | `_families`; `_dispatch` |
| what accumulation asks of a wrapped optimizer, one interface per family | `_inner` (`InnerApi`, and the readers Keras 3 and tf_keras new-style share; the families' `_inner` modules implement it) |
| `flush_callback`; the warning when `compile` drops pending micro-steps | `_flush`; `_recompile` |
| what is read off the call stack (the model a Keras method runs for; the module constructing a `BatchNormalization`), its `PRIVATE_NAMES` | `_callers` |
| an instance's methods changed in one place: a wrapped optimizer's while its update is traced, a model's `compile` and train step until taken back | `_shadow` |
| `modes/`: what a mode asks of a family, declared once; the three modes and `step_for` (which step a micro-step runs), once for every family (TensorFlow ops; `"momentum"`'s slot adapter too), and `"buffer"` under `tf.distribute` | `_family` (`Family`), `_modes` (`Buffer`, `Momentum`, `Rescale`, `step_for`, `PassThrough`), `_window` (`WindowState`, `Window`), `_momentum`, `_rescale`, `_distributed` (`LOCAL_WINDOW`) |
| `keras3/`: Keras 3 (TensorFlow and JAX backends), and `local_gradients` (JAX) | `_optimizer`, `_jax`, `_buffer_step`, `_rescale_step`, `_batchnorm`, `_local_jax`, `_inner` |
| `tf_keras/`: tf_keras new-style and legacy | `_common`, `_optimizer`, `_legacy`, `_rescale_step`, `_batchnorm`, `_inner`, `_inner_legacy` |
| `batchnorm/`: `accum.BatchNormalization` and the warning | `_layer`, `_warning` |

The imports go down: this module -> `_dispatch` -> the family packages
(`keras3/`, `tf_keras/`) -> `_base` -> `batchnorm/` -> `modes/` -> `_validation`,
`_recompile` (-> `_callers`), `_families`, `_shadow` and `_inner` (which import nothing of
`accum` above them; no import runs back up). `modes/` imports no family package and never sees a wrapper:
what a mode needs of a family is one object, the family's `modes._family.Family`
(`ops`: `_base.WrapperOps`, with `keras3._optimizer.Keras3Ops` or
`tf_keras._common.TFKerasOps`), passed to every step, and the family's `_inner`.

A micro-step is one call: the wrapper's `_micro_step` runs the step that
`modes._modes.step_for` selected at `build` (`_step`, or `_local_step` in a replica
context under a strategy): `PassThrough` (`"buffer"`, `k=1`),
`modes._distributed.LOCAL_WINDOW` (`"buffer"` under `tf.distribute`), the family's
buffer window (`"buffer"`), or the mode itself (`"momentum"`, `"rescale"`).

One update (Keras 3, `mode="buffer"`, TensorFlow or JAX) stays in four modules:
`keras3._optimizer` (`apply`: the variables' indices from `keras3._inner`) ->
`keras3._buffer_step.BufferWindow.micro_step` (adds to the buffers and counts, by
selects, in the `WindowState` of the wrapper's variables) -> its
`end_window_when` -> the backend's `update_when`, given to the window when it was
built (`keras3._optimizer`: `tf.cond`; `keras3._jax`: `jax.lax.cond`) -> the inner
optimizer on the window's mean, its writes masked by the touched flags
(`keras3._buffer_step.masked_apply`, shadowing its methods with `_shadow`); then
the window is zeroed. tf_keras goes `tf_keras._common` -> `modes._window.Window`
(TensorFlow ops, `tf.cond`) -> `tf_keras._common.TFKerasOps.apply_inner`.
"""

from ._base import AccumOptimizer
from . import _dispatch
from .batchnorm._warning import has_batch_normalization, warn_if_batch_normalization
from .batchnorm._layer import BatchNormalization
from .keras3._local_jax import local_gradients

__all__ = ["AccumOptimizer", "BatchNormalization", "has_batch_normalization", "local_gradients",
           "warn_if_batch_normalization"]
__version__ = "0.1.0"

# `AccumOptimizer(...)` and `BatchNormalization(...)` build the family's class (`accum._dispatch`,
# which the classes cannot import: it imports the families, which import them).
_dispatch.link(AccumOptimizer, BatchNormalization)
# `load_model` of a model compiled with `AccumOptimizer` needs only `import accum`.
_dispatch.register_serializable_classes()
