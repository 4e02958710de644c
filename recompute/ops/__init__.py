"""The operations a recomputed block runs differently from Keras: what the policies keep small.

- `_flash`: FlashAttention-2 (Dao, 2023) written once in framework ops (`forward`,
  `backward` over an `Engine`), the rule that picks it or the layer's own core
  (`runs_blocked`, by shape, engine and policy) and its settings (`attention_core`,
  `attention_block_size`); its engines `_flash_tf` (`tf.custom_gradient` over a
  `tf.while_loop`; one sample at a time where a sample's tile is large) and `_flash_jax`
  (`jax.custom_vjp` over a `fori_loop`).
- `_attention`: Keras's `MultiHeadAttention` core run as that core (both families), its
  dropout decided once per step and kept as bits (`recompute.engine._core.kept`).
- `_gelu`: the exact GELU with a gradient that keeps only its input (a custom gradient,
  or `jax.checkpoint` on JAX); `gelu_matmul`, a GELU and the product it feeds under one
  gradient that keeps the GELU's input alone and runs in chunks of rows (bert4keras's
  `FeedForward`, `_lean`).
- `_layer_norm`: `LayerNormalization` with a gradient, in closed form, that keeps only its
  input (TensorFlow).
- `_feed_forward_jax`: under `"full"` on JAX, a `Dense` with an activation feeding a `Dense`
  without one runs as one operation whose gradient keeps the first product and runs in
  row blocks (`fused`, `feed_forward`).
- `_lean`: `lean_layers`, the block's layers under `"attention"` on TensorFlow: the GELUs
  and LayerNorms above, the `Dense` layers they feed, which make their input again for
  the kernel's gradient (`matmul_recomputing_input`, bert4keras's `FeedForward` too), the
  `Dense` and `EinsumDense` layers of a later block fed a LayerNorm's output (the next
  block's query, key and value projections fed the block's output), which make it again
  from the LayerNorm's kept input (`remake_of`, `einsum_recomputing_input`), and
  the block's own `Dropout` layers, which keep their decision as bits (`dropout_call`);
  `remaking_input`, for a `Dense` fed a tensor another layer makes again (bert4keras's
  attention fed by a LayerNormalization unit).
- `_window_tf`: dropout on TensorFlow inside a recomputed `"full"` call: in a cut of the
  batch (`recompute.engine._cuts_tf`), the whole batch's random numbers drawn for the cut's
  samples only (`windowed_draws`: Keras 3's `Dropout` layers here, `window_uniform`,
  `windowed_dropouts`; tf_keras's draws in `recompute.adapters._tf_keras`); in Keras's own
  attention core, its decision drawn once a step and kept as bits (`decided_once`).

They use `recompute.engine` (TensorFlow's `kept`, `after`) and `recompute.adapters`;
`recompute.policies` and the integrations use them.
"""
