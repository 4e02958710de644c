"""Exact gradient accumulation for Keras 3 and tf_keras.

```python
from accum import AccumOptimizer

model.compile(optimizer=AccumOptimizer(keras.optimizers.Adam(), steps_per_update=8), ...)
model.fit(x, y, batch_size=4)       # trains like batch_size=32
```

Under `tf.distribute.MirroredStrategy` or `MultiWorkerMirroredStrategy`, build
the model and the optimizer in `strategy.scope()`; each replica accumulates
locally and the replicas all-reduce once per update, not once per micro-batch
(`accum._distributed`; `python -m benchmarks.accum_distribute` measures it).
On JAX under `keras.distribution`, `accum.local_gradients(model)` does the same
(`accum._local_jax`; `python -m benchmarks.accum_local_jax`).

Where things are:

| | files |
|---|---|
| the public class, the family hooks it declares | `_base` (`AccumOptimizer`) |
| the modes (what each builds, does at a micro-step and at the window's end, whether it can be distributed or flushed) | `_modes` (`Buffer`, `Momentum`, `Rescale`) |
| the window's state and its TensorFlow ops | `_window` (`WindowState`) |
| `"momentum"` | `_momentum` + `_momentum_keras3` / `_momentum_tf_keras` |
| `"rescale"` (β̃ = 1 − (1 − β)/k, no buffer) | `_rescale` + `_rescale_keras3` / `_rescale_tf_keras` |
| Keras 3 on TensorFlow / on JAX | `_keras3` / `_keras3_jax` (each gives the conditional around the inner update: `tf.cond` in place / `jax.lax.cond` around `stateless_apply`) |
| `"buffer"` on Keras 3, both backends (`keras.ops`, selects) | `_buffer_keras3` |
| tf_keras / tf_keras legacy | `_tf_keras_common` + `_tf_keras` / `_tf_keras_legacy` |
| `tf.distribute` | `_distributed` |
| `keras.distribution` on JAX, one all-reduce per update: `local_gradients(model)` (its train step under `jax.shard_map`; the buffers' rows, one per shard) | `_local_jax` |
| `accum.BatchNormalization` (the big batch's moving statistics) | `_batchnorm_window` + `_batchnorm_keras3` / `_batchnorm_tf_keras`; `_batchnorm` (the warnings) |
| which family an optimizer is, which class serves it | `_families`, `_dispatch` |
| the wrapped optimizer's private API, one interface per family (the only modules that use its private names) | `_inner` (`InnerApi`) + `_inner_keras3` / `_inner_tf_keras` / `_inner_tf_keras_legacy` |
| argument checks; `flush_callback`; `compile` dropping micro-steps | `_validation`; `_flush`; `_recompile` |

One update (Keras 3, `mode="buffer"`, TensorFlow or JAX) goes through three
modules: `_keras3` (`apply` -> `_micro_step`) -> `_buffer_keras3.micro_step`
(adds to the buffers and counts, by selects, in the `WindowState` of the
wrapper's variables) -> `_buffer_keras3.end_window_when` (window full) -> the
backend's `_update_when` (`_keras3`: `tf.cond`; `_keras3_jax`: `jax.lax.cond`)
-> the inner optimizer on the window's mean, its writes masked by the touched
flags (`_buffer_keras3.masked_updates`; `_window.protect_untouched`); then the
window is zeroed. tf_keras goes `_tf_keras_common` -> `_modes.Buffer` ->
`_window` (TensorFlow ops, `tf.cond`).
"""

from ._base import AccumOptimizer
from ._dispatch import register_serializable_classes as _register
from ._batchnorm import has_batch_normalization, warn_if_batch_normalization
from ._batchnorm_window import BatchNormalization
from ._local_jax import local_gradients

__all__ = ["AccumOptimizer", "BatchNormalization", "has_batch_normalization", "local_gradients",
           "warn_if_batch_normalization"]
__version__ = "0.1.0"

# `load_model` of a model compiled with `AccumOptimizer` needs only `import accum`.
_register()
del _register
