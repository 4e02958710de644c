"""What a call decorated with `recompute_grad` recomputes, on each engine.

- `_registry`: the registry `POLICIES` (its names: `NAMES`, `recompute.POLICIES`) of each
  policy's TensorFlow and JAX functions, and the TensorFlow ones: `"full"` (the call is
  one `recompute.engine._core` recomputation), `"attention"` (only the attention cores
  and GELUs are recomputed), `check_policy`.
- `_jax`: Keras 3's JAX backend: the call as a `jax.checkpoint` with the layer's state
  threaded through, and the policies' JAX functions.

`recompute._decorator` and the integrations (`recompute.bert4keras`, `recompute.keras_hub`)
call them.
"""
