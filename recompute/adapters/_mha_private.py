"""The private names of Keras's `MultiHeadAttention` that recomputation relies on, read
here and nowhere else (Keras 3 and tf_keras name them alike).

Neither Keras has a public API for a `MultiHeadAttention` layer's attention core (the
method `CORE`, which policy="attention" recomputes and `recompute.ops._attention` runs
blocked), nor for the parts of the layer that core uses: its dropout rate and dropout
layer, its scale (`key_dim`), its masked softmax, its attention axes, whether it takes
Keras 3's fused flash path, and Keras 3's causal mask. `PRIVATE_NAMES` lists them as
`(attribute, owners)`, in the format of `recompute.adapters._names`: an attribute that each owner
-- a `MultiHeadAttention` class by its import path; the interface tests build the layer
-- must have. tests/recompute_keras3/test_private_interface.py checks Keras 3's,
tests/recompute_tf_keras/test_private_interface_tf_keras.py tf_keras's, against the
installed versions, so that a Keras release that renames one fails there, naming it.
"""

from ._names import owned_by

CORE = "_compute_attention"  # the attention core: scaled scores, masked softmax, dropout, x values

KERAS3 = "keras.layers.MultiHeadAttention"
TF_KERAS = "tf_keras.layers.MultiHeadAttention"
_BOTH = (KERAS3, TF_KERAS)

PRIVATE_NAMES = (
    owned_by(_BOTH, CORE, "_dropout", "_dropout_layer", "_key_dim", "_softmax", "_masked_softmax",
             "_attention_axes")
    # `_flash_attention`: tf_keras has none, read with a default (False);
    # `_compute_causal_mask`: Keras 3's `use_causal_mask`
    + owned_by((KERAS3,), "_flash_attention", "_compute_causal_mask")
)


def dropout_rate(layer):
    """The layer's dropout rate (0 if it has none)."""
    return getattr(layer, "_dropout", 0)


def dropout_layer(layer):
    """The `Dropout` layer the core applies to the probabilities."""
    return layer._dropout_layer


def own_dropout(layer):
    """`dropout_layer(layer)` for a `MultiHeadAttention` layer (one with the core), else None."""
    return getattr(layer, "_dropout_layer", None) if hasattr(layer, CORE) else None


def key_dim(layer):
    """The size of each head of the queries and keys (the scores' scale is `1 / sqrt` of it)."""
    return layer._key_dim


def softmax(layer):
    """The layer's softmax layer (its `compute_dtype` is the probabilities' dtype)."""
    return layer._softmax


def masked_softmax(layer, scores, mask):
    """The layer's softmax of `scores` under `mask` (which it expands as its core does)."""
    return layer._masked_softmax(scores, mask)


def masked_logits(layer, scores, mask):
    """`(logits, keep)`: what the layer's masked softmax (`_masked_softmax`: its `Softmax`
    layer with a mask, the mask expanded as the core expands it) takes the softmax of,
    and None or the bool entries it keeps after the softmax. Keras 3: the scores, -1e9
    where the mask (numeric: > 0.5) is off, and the softmax's masked entries zeroed after
    it (a fully masked row is zeros); tf_keras: `scores + (1 - mask) * -1e9`, nothing
    zeroed (with the `Softmax`'s `robust_masking`, -1e9 where the mask is off). Only for
    float32 and float64 scores (half precision's large negative differs: the blocked core
    does not run there)."""
    if mask is None:
        return scores, None
    axis = -len(attention_axes(layer) or (1,)) * 2 - 1
    if any(c.__module__.startswith("tf_keras.") for c in type(layer).__mro__):
        import tensorflow as tf

        while mask.shape.rank < scores.shape.rank:
            mask = tf.expand_dims(mask, axis=axis)
        if getattr(softmax(layer), "robust_masking", False):
            if mask.dtype != tf.bool:
                mask = tf.greater(mask, tf.constant(0.5, dtype=mask.dtype))
            return tf.where(mask, scores, tf.constant(-1e9, scores.dtype)), None
        return scores + (1.0 - tf.cast(mask, scores.dtype)) * tf.constant(-1e9, scores.dtype), None
    from keras import ops

    while len(mask.shape) < len(scores.shape):
        mask = ops.expand_dims(mask, axis=axis)
    if ops.dtype(mask) != "bool":
        mask = ops.greater(mask, ops.cast(0.5, mask.dtype))
    return ops.where(mask, scores, ops.cast(-1e9, scores.dtype)), mask


def attention_axes(layer):
    """The axes attention is applied over (None or missing: the default, the sequence)."""
    return getattr(layer, "_attention_axes", (1,))


def uses_flash_attention(layer):
    """True if the layer takes Keras 3's fused flash path (False in tf_keras)."""
    return getattr(layer, "_flash_attention", False)


def causal_mask(layer, query, value):
    """Keras 3's causal mask of a call with `use_causal_mask=True`, as the layer builds it."""
    return layer._compute_causal_mask(query, value)
