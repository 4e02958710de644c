"""What a call decorated with `recompute_grad` recomputes: each policy one function per
engine, which `recompute.engine`'s `run` calls, handed what it needs.

- `_registry`: the registry `POLICIES` (its names: `NAMES`, `recompute.POLICIES`) of each
  policy's `Policy(tensorflow, jax)`, the TensorFlow functions -- `"full"` (the call is
  one `recompute.engine._core` recomputation, for a Keras 3 block or a tf_keras layer
  declared per-sample (bert4keras's blocks) in cuts of its batch:
  `recompute.engine._cuts_tf`), `"attention"` (only the attention cores and GELUs are
  recomputed) -- and `check_policy`.
- `_blocks`: which Keras 3 calls are blocks (`kept_block`) and where one runs in cuts of
  its batch (`cut_samples`), both engines'; on tf_keras, the layers their builders declare
  per-sample (`declare_per_sample`, `declared_cut_samples`).
- `_jax`: the policies' functions on Keras 3's JAX backend (`full`, `attention`), run
  on the JAX engine (`recompute.engine._jax`).

`recompute._decorator` and the integrations (`recompute.bert4keras`, `recompute.keras_hub`)
call them.
"""
