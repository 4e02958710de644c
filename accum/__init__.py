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

Modes: `"buffer"` (exact; `accum._window`), `"momentum"` (`accum._momentum`)
and `"rescale"` (`accum._rescale`: β̃ = 1 − (1 − β)/k, no buffer), each an
object of `accum._modes` (what it builds, does at a micro-step and at the
window's end, whether it can be distributed or flushed) that the families ask.
`accum.BatchNormalization` (`accum._batchnorm_window`) keeps the big batch's
moving statistics; the optimizer ends its window.

The Keras families (Keras 3 / tf_keras / tf_keras legacy) are told apart in
`accum._families`; `accum._dispatch` picks the implementation for each (and for
Keras 3 on the JAX backend, `accum._keras3_jax`: the window through
`stateless_apply`, the inner update in a `jax.lax.cond`).
"""

from ._base import AccumOptimizer
from ._dispatch import register_serializable_classes as _register
from ._batchnorm import has_batch_normalization, warn_if_batch_normalization
from ._batchnorm_window import BatchNormalization

__all__ = ["AccumOptimizer", "BatchNormalization", "has_batch_normalization", "warn_if_batch_normalization"]
__version__ = "0.1.0"

# `load_model` of a model compiled with `AccumOptimizer` needs only `import accum`.
_register()
del _register
