"""BatchNormalization under accumulation, both families.

| module | what |
|---|---|
| `_layer` | `accum.BatchNormalization`'s shared part: the window's sums, the big batch's statistics at the window's end (`finish_window`, `finish_windows`), the link to the `AccumOptimizer` that trains it |
| `_warning` | `has_batch_normalization`, `warn_if_batch_normalization`: Keras's own layer keeps per-micro-batch statistics |

The family classes are `accum.keras3._batchnorm` and `accum.tf_keras._batchnorm`
(picked by `accum._dispatch.batch_normalization_class`). Imports: `_warning` ->
`_layer` -> `accum.modes._distributed` (replica-local sums), `accum._recompile`; both ->
`accum._callers` (the model being trained, the model whose train step runs the layer,
the module constructing it: what Keras links to nothing, read off the call stack).
"""
