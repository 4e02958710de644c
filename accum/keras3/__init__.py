"""The Keras 3 family (`keras.optimizers.*`, TensorFlow and JAX backends): the wrapper, its
modes' Keras 3 parts, its `BatchNormalization`, and `accum.local_gradients` (JAX).

| module | what |
|---|---|
| `_optimizer` | `Keras3AccumOptimizer` (TensorFlow backend): `apply`, the micro-step (one call of the selected step), the masked inner update in a `tf.cond`; `Keras3Ops`, its `accum.modes._family.Family` (the window's variables, the loss scale, the inner update) |
| `_jax` | `JaxAccumOptimizer`: the same, the inner update in a `jax.lax.cond` around `stateless_apply`; buffers with one row per device |
| `_buffer_step` | `mode="buffer"`: `BufferWindow`, its micro-step and window end in `keras.ops` (both backends), built with what the family gives it; the masked inner update |
| `_rescale_step` | `mode="rescale"`: one micro-step in `keras.ops` (both backends), on the wrapper's state given as an `accum.modes._rescale.Step` (the family's `Keras3Ops.rescale_steps`) |
| `_batchnorm` | `Keras3BatchNormalization`, `accum.BatchNormalization` for Keras 3 |
| `_local_jax` | `accum.local_gradients(model)`: under `keras.distribution` on JAX, a train step under `jax.shard_map` that keeps each device's gradients in its own row of the buffers (`DeviceRows`, `SavedRows`), one all-reduce per update |
| `_inner` | the wrapped optimizer's private API (`accum._inner.InnerApi`, `PRIVATE_NAMES`): with the readers it takes from `accum._inner`, the only module of `accum` that touches Keras 3's private names |

`mode="momentum"` needs no module here: the wrapper gives `accum.modes._momentum.rule_for`
this family's `_inner` and its SGD, Adam and AdamW classes.

Imports go down: `_jax` -> `_optimizer` -> `_buffer_step`, `_rescale_step` -> `_inner`
(-> `accum._inner`, the readers shared with tf_keras); `_jax` -> `_local_jax` (the rows) -> `_inner`. The
optimizer imports `accum._base`, `accum.modes` and `accum.batchnorm._warning`;
`accum._dispatch` picks `_optimizer` or `_jax` by the backend.
"""
