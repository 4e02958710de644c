"""The tf_keras families (`tf_keras.optimizers.*` new-style, `tf_keras.optimizers.legacy.*`):
every module of `accum` that imports tf_keras (loaded only where a program uses it).

| module | what |
|---|---|
| `_common` | `TFKerasWindow`, the mixin both wrappers share: the micro-step (one call of the selected step), delegation, serialization; `TFKerasOps`, their `accum.modes._family.Family`: the window's state, the masked inner update, the loss scale's skip |
| `_optimizer` | `TFKerasAccumOptimizer` (new-style optimizers) |
| `_legacy` | `LegacyAccumOptimizer` (legacy `OptimizerV2`: buffers are slots) |
| `_rescale_step` | `mode="rescale"`: one micro-step in TensorFlow ops, on the wrapper's state given as an `accum.modes._rescale.Step` (new-style only; refuses legacy optimizers) |
| `_batchnorm` | `TFKerasBatchNormalization`, `accum.BatchNormalization` for tf_keras |
| `_inner`, `_inner_legacy` | the wrapped optimizer's private API (`accum._inner.InnerApi`, `PRIVATE_NAMES`), new-style and legacy: with the readers they take from `accum._inner`, the only modules of `accum` that touch tf_keras's private names |

`mode="momentum"` needs no module here: `_common` gives `accum.modes._momentum.rule_for`
the optimizer's `_inner` or `_inner_legacy` and the SGD, Adam and AdamW classes of both kinds.

Imports go down: `_optimizer`, `_legacy` -> `_common` -> `_rescale_step` -> `_inner`,
`_inner_legacy` (-> `accum._inner`, the readers shared with Keras 3); the wrappers import `accum._base`,
`accum.modes` (the window's TensorFlow ops, `tf.distribute`) and
`accum.batchnorm._warning`. `accum._dispatch` picks `_optimizer` or `_legacy` by the family.
"""
