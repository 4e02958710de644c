"""The tf_keras families (`tf_keras.optimizers.*` new-style, `tf_keras.optimizers.legacy.*`):
every module of `accum` that imports tf_keras (loaded only where a program uses it).

| module | what |
|---|---|
| `_common` | `TFKerasWindow`, the mixin both wrappers share: the micro-step, delegation, the window's state, the masked inner update, serialization |
| `_optimizer` | `TFKerasAccumOptimizer` (new-style optimizers) |
| `_legacy` | `LegacyAccumOptimizer` (legacy `OptimizerV2`: buffers are slots) |
| `_slots` | `mode="momentum"`: the `MomentumRule` adapter to SGD/Adam/AdamW's slots (both kinds) |
| `_rescale_step` | `mode="rescale"`: one micro-step in TensorFlow ops (new-style only) |
| `_batchnorm` | `TFKerasBatchNormalization`, `accum.BatchNormalization` for tf_keras |
| `_inner`, `_inner_legacy` | the wrapped optimizer's private API (`accum._inner.InnerApi`, `PRIVATE_NAMES`), new-style and legacy: the only modules of `accum` that touch tf_keras's private names |

Imports go down: `_optimizer`, `_legacy` -> `_common` -> `_slots`,
`_rescale_step` -> `_inner`, `_inner_legacy`; the wrappers import `accum._base`,
`accum.modes` (the window's TensorFlow ops, `tf.distribute`) and
`accum.batchnorm._warning`. `accum._dispatch` picks `_optimizer` or `_legacy` by the family.
"""
