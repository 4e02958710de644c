"""The recomputation on TensorFlow: `_core.Recomputation`, one `tf.custom_gradient` around
a layer's call (forward out of the tapes' reach, backward under a fresh tape in the same
call context, unpack), with `kept` (a value computed once per step and kept through the
recomputation: dropout decisions) and `after` (a value gated on the incoming gradient, so
that a recomputation does not run early). It asks its Keras family through
`recompute.adapters`. On Keras 3's JAX backend the engine is `jax.checkpoint`
(`recompute.policies._jax`).
"""
