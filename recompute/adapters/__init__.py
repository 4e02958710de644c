"""What `recompute` asks of a Keras family and of TensorFlow, and every private name it reads.

The bottom floor: these modules import nothing of `recompute` but each other (and
`recompute._errors`).

- `_adapter`: the interface between the recomputation (`recompute.engine._core`) and one
  Keras family (`Adapter`: where a layer's random and moving state lives, how its call
  context is re-entered, where its losses go).
- `_keras3` (Keras 3 on TensorFlow) and `_tf_keras` (tf_keras, which bert4keras runs on):
  its two implementations; `_backends` picks one by the layer's class (and tells a Keras 3
  layer on JAX, which `recompute.engine._jax` recomputes instead).
- The interface modules, each listing the private names it reads in its `PRIVATE_NAMES`
  (checked against the installed versions by the `test_private_interface*` tests):
  `_keras_private` (Keras 3's), `_mha_private` (`MultiHeadAttention`'s, both families),
  `_tf_keras` (tf_keras's), `_tf` (TensorFlow's internals: pausing the tapes, the graph
  contexts; whether TensorFlow sees a GPU; and, with public raw ops, how its Philox kernels
  count their numbers, for a cut's draws of the batch's); `_names` writes their format
  (`owned_by`).
"""
