"""The attention core with fewer [batch, heads, seq, seq] tensors kept.

An attention core computes `probs = softmax(mask(q k^T / sqrt(d)))`, then
`dropout(probs) @ v`. TensorFlow's autodiff of the dropout and the product
keeps the probabilities, the dropped probabilities and the bool keep-mask, and
runs its gradient through the dropout's scaled copy. Two lean forms, both with
the layer's own ops and random numbers in the forward pass (values bit for bit
those of the layer's own core), the dropout's decision (`_decision`, a bool
mask) held from the forward pass to the backward pass as bits (`pack_bits`,
1 bit per entry) and the gradients of the dropout and the product taken by
hand as autodiff takes them (`_combine_gradients`):

- `dropout_then_combine`: the probabilities are kept (for a core recomputed
  as part of a larger unit: bert4keras's "layer" and "block" policies); the
  decision is kept from the forward pass through the unit's recomputation
  (`_core.kept`), so the recomputation draws no random numbers for it;
- `recomputed_core`: a unit that keeps only its inputs and the mask, and
  recomputes the scores and the softmax when the gradient arrives -- no
  random number is drawn again (the "attention" policy: Megatron-LM's
  selective recomputation, with the mask kept rather than redrawn; on CPU
  the float draw costs more than the softmax and the products).

`keras_core` runs Keras's `MultiHeadAttention._compute_attention` (Keras 3 and
tf_keras: the same attribute names) as `recomputed_core` in the standard case
-- rank-4 inputs, dropout on with a Python `training` flag, no causal mask of
Keras 3's own -- and returns None elsewhere (the layer's own core is then
recomputed as a call). bert4keras's core uses both forms
(`recompute.bert4keras._attention`).
"""

import inspect
import math

import tensorflow as tf

from . import _core, _flash
from ._core import after


def _gradient_equations(equation):
    """For `"x,y->z"`: the equations of the gradients of `x` and of `y`, or None when
    an index is summed within one operand (then these would not be the gradients)."""
    inputs, output = equation.replace(" ", "").split("->")
    x, y = inputs.split(",")
    if "." in equation or any(len(set(s)) != len(s) for s in (x, y, output)):
        return None
    if any(i not in y and i not in output for i in x) or any(i not in x and i not in output for i in y):
        return None
    return f"{output},{y}->{x}", f"{x},{output}->{y}"


def _decision(probs, dropped, rate, training):
    """The dropout decision behind `dropped = dropout(probs)`: `(keep, scale)`.

    `keep = dropped != 0`. It differs from the dropout's own mask only where
    `probs` is 0 (padding, underflow), where the gradient of the probabilities
    is 0 either way: the softmax's gradient is `p * (dp - sum(dp * p))`. `scale`
    is `1 / (1 - rate)` where the dropout ran and 1 where it did not (inference):
    known from `training` when it is a Python bool, else read off the values
    (in training, some nonzero probability differs from its dropped value).
    """
    keep = tf.not_equal(dropped, tf.zeros([], dropped.dtype))
    on = tf.constant(1.0 / (1.0 - rate), probs.dtype)
    if isinstance(training, bool):
        return keep, on if training else tf.ones([], probs.dtype)
    ran = tf.reduce_any(tf.not_equal(dropped, probs))
    return keep, tf.where(ran, on, tf.ones([], probs.dtype))


# Eight 0/1 bytes read as one little- or big-endian 64-bit word: a product
# with _GATHER moves byte i's bit to bit i of the top byte (the partial
# products are distinct powers of 2, so nothing carries); a byte times
# _SPREAD is that byte in all eight, and _SELECT keeps bit i in byte i.
_GATHER, _SPREAD, _SELECT = 0x0102040810204080, 0x0101010101010101, 0x8040201008040201


def pack_bits(mask):
    """A bool tensor as 1 bit per entry: a uint8 vector of `ceil(size / 8)`.

    The dropout's decision is the one [batch, heads, seq, seq] tensor the lean
    cores keep from the forward pass to the backward pass (across every layer
    of the model under the "block" and "attention" policies): as bits it takes
    an eighth of the bytes of a bool mask. Eight entries are packed by one
    64-bit product (measured on CPU: packing and unpacking cost together
    about a third of a softmax over the same shape). `unpack_bits` inverts it
    exactly.
    """
    flat = tf.cast(tf.reshape(mask, [-1]), tf.uint8)
    size = mask.shape.num_elements()  # static where known (XLA needs the padding constant)
    pad = tf.math.floormod(-tf.size(flat), 8) if size is None else -size % 8
    if size is None or pad:
        flat = tf.pad(flat, [[0, pad]])
    words = tf.bitcast(tf.reshape(flat, [-1, 8]), tf.uint64) * tf.constant(_GATHER, tf.uint64)
    return tf.cast(tf.bitwise.right_shift(words, tf.constant(56, tf.uint64)), tf.uint8)


def unpack_bits(bits, like):
    """The bool tensor of `like`'s shape that `pack_bits` packed into `bits`."""
    words = tf.bitwise.bitwise_and(tf.cast(bits, tf.uint64) * tf.constant(_SPREAD, tf.uint64),
                                   tf.constant(_SELECT, tf.uint64))
    flat = tf.reshape(tf.not_equal(tf.bitcast(words, tf.uint8), tf.zeros([], tf.uint8)), [-1])
    size = like.shape.num_elements()
    if size is None:
        shape = tf.shape(like)
        return tf.reshape(flat[:tf.reduce_prod(shape)], shape)
    return tf.reshape(flat[:size] if size % 8 else flat, like.shape)


def _packed(keep, scale):
    """What a lean core keeps of its dropout's decision `(keep, scale)`: the mask as bits."""
    return (None if keep is None else pack_bits(keep)), scale


def _unpacked(packed, probs):
    """`(keep, scale)` back from `_packed(keep, scale)`, for the (recomputed) `probs`: made to
    wait for them, so that a graph executor unpacks it in the backward pass, not in
    the forward pass (`_core.after`)."""
    bits, scale = packed
    if bits is None:
        return None, scale
    return unpack_bits(after([bits], probs)[0], probs), scale


def _dropped(probs, keep, scale):
    return probs if keep is None else tf.where(keep, probs * scale, tf.zeros([], probs.dtype))


def _combine_gradients(probs, value, keep, scale, d_out, equation):
    """The gradients of `einsum(equation, where(keep, probs * scale, 0), value)`
    for `probs` and `value`: those autodiff computes, by the transposed products."""
    d_probs_eq, d_value_eq = _gradient_equations(equation)
    d_value = tf.einsum(d_value_eq, _dropped(probs, keep, scale), d_out)  # formed again
    d_dropped = tf.einsum(d_probs_eq, d_out, value)
    d_probs = d_dropped if keep is None else tf.where(
        keep, d_dropped * scale, tf.zeros([], d_dropped.dtype))
    return d_probs, d_value


def _drop(probs, dropout, rate, training):
    """`(dropout(probs), keep, scale)`; `(probs, None, None)` without a dropout."""
    if dropout is None or not rate:
        return probs, None, None
    dropped = dropout(probs)
    if dropped is probs:  # Keras 3's dropout outside training
        return probs, None, None
    keep, scale = _decision(probs, dropped, rate, training)
    return dropped, keep, scale


def dropout_then_combine(probs, value, dropout, rate, equation, training=None):
    """`einsum(equation, dropout(probs), value)`, whose gradient keeps `probs` and a
    the dropout's bits only (for a core that is recomputed as part of a larger unit).

    Args:
        probs: the attention probabilities.
        value: the values.
        dropout: `dropout(x)`, the layer's own dropout (None: no dropout).
        rate: its rate (a Python float).
        equation: the einsum equation of probabilities and values (no index
            summed within one operand).
        training: the dropout's training flag where it is a Python bool (else
            `_decision` reads it off the values).

    Returns:
        The attended values, equal bit for bit to `einsum(equation, dropout(probs),
        value)` for a dropout computing `where(keep, x / (1 - rate), 0)`.
    """
    if _core.inside_recomputed_call():
        # Inside a recomputed layer or block, the decision is kept from the
        # forward pass, as bits: the recomputation neither draws it again nor
        # needs the dropout.
        dropped = keep = scale = None

        def decide():
            nonlocal dropped, keep, scale
            dropped, keep, scale = _drop(probs, dropout, rate, training)
            return _packed(keep, scale)

        packed = _core.kept(decide)
        if dropped is None:  # the recomputation
            keep, scale = _unpacked(packed, probs)
            dropped = _dropped(probs, keep, scale)
    else:
        dropped, keep, scale = _drop(probs, dropout, rate, training)

    @tf.custom_gradient
    def combine(probs, value):
        def grad(d_out):
            return _combine_gradients(probs, value, keep, scale, d_out, equation)

        return tf.einsum(equation, dropped, value), grad

    return combine(probs, value)


def recomputed_core(probabilities, query, key, value, dropout, rate, equation,
                    training=None, second_asked=False):
    """An attention core that keeps its inputs and the dropout's decision as bits, and
    recomputes the probabilities for the gradient.

    Forward: `probs, second = probabilities(query, key)` (the scores, mask and
    softmax), `dropped = dropout(probs)` -- the layer's own dropout, once -- and
    `einsum(equation, dropped, value)`, the very ops of the layer's own core.
    Backward (when the gradient arrives): `probabilities` runs again under a
    tape, and the dropout and product take their gradients by hand from the
    kept mask (`_combine_gradients`); no random number is drawn again.

    Args:
        probabilities: `(query, key, again) -> (probs, second)`, deterministic;
            `second` is the core's second output (the probabilities or the
            scores). With `again=False` (the forward pass) it runs the layer's
            own ops; with `again=True` (the recomputation) it may compute the
            same values by faster ops, equal to float rounding.
        query, key, value: the core's float inputs.
        dropout, rate, equation, training: as `dropout_then_combine`.
        second_asked: whether the caller uses `second` (else None is returned).

    Returns:
        `(output, second or None)`, the layer's own values bit for bit.
    """

    @tf.custom_gradient
    def core(query, key, value):
        probs, second = probabilities(query, key, False)
        dropped, keep, scale = _drop(probs, dropout, rate, training)
        output = tf.einsum(equation, dropped, value)
        packed = _packed(keep, scale)  # the mask as bits, until the gradient

        def grad(d_out, d_second=None):
            q, k = after([query, key], d_out)  # recomputed when the gradient arrives
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch([q, k])
                probs, second = probabilities(q, k, True)
            keep, scale = _unpacked(packed, probs)
            d_probs, d_value = _combine_gradients(probs, value, keep, scale, d_out, equation)
            targets, seeds = [probs], [d_probs]
            if d_second is not None:
                targets.append(second)
                seeds.append(d_second)
            d_q, d_k = tape.gradient(targets, [q, k], output_gradients=seeds)
            return d_q, d_k, d_value

        if second_asked:
            return (output, second), grad
        return output, grad

    result = core(query, key, value)
    return tuple(result) if second_asked else (result, None)


def is_keras_core(core):
    """True if `core` is Keras's own `_compute_attention` (Keras 3 or tf_keras), not
    a subclass's."""
    module = getattr(core, "__module__", "") or ""
    return getattr(core, "__name__", None) == "_compute_attention" and module.startswith(
        ("keras.", "tf_keras."))


def keras_blocked(engine, core, layer, args, kwargs, scores_asked):
    """`core(layer, *args, **kwargs)` -- Keras's `MultiHeadAttention._compute_attention`
    -- as the blocked core of `engine` (`_flash_tf` or `_flash_jax`), or None if
    the call is not the standard case (then the caller runs or recomputes `core`
    itself): rank-4 inputs ([batch, seq, heads, dim]), one attention axis, dropout
    > 0 with a Python `training` flag, no flash attention of Keras's own.

    The dropout's decision is drawn once, in the forward pass, by the layer's own
    dropout layer (on ones of the probabilities' shape and dtype: the same
    random numbers as RECOMPUTE=0's), and held as bits packed along the keys;
    inside a recomputed call it is kept from the forward pass to the
    recomputation (`_core.kept`), not drawn again. Keras 3's causal mask
    (`use_causal_mask`) is built as Keras builds it. When the caller uses the
    scores (`scores_asked`; tf_keras always says so), they are the layer's own
    probabilities, computed whole beside the blocked core: in `tf.function`,
    `fit` and `jax.jit` they are pruned when unused.

    Returns `(attention_output, attention_scores or None)`.
    """
    if not is_keras_core(core):
        return None
    try:
        bound = inspect.signature(core).bind(layer, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    rate, training = getattr(layer, "_dropout", 0), a["training"]
    if (
        getattr(layer, "_flash_attention", False)
        or not isinstance(rate, float) or rate <= 0.0 or not isinstance(training, bool)
        or len(query.shape) != 4 or len(key.shape) != 4 or len(value.shape) != 4
        or None in (query.shape[1], key.shape[1], query.shape[2])
        or tuple(getattr(layer, "_attention_axes", (1,)) or (1,)) != (1,)
    ):
        return None
    mask = a["attention_mask"]
    if a.get("use_causal_mask"):  # Keras 3: as its own core builds it
        from keras import ops

        causal = layer._compute_causal_mask(query, value)
        mask = causal if mask is None else ops.logical_and(ops.cast(mask, "bool"), causal)
    while mask is not None and len(mask.shape) < 4:  # as `_masked_softmax` expands it
        mask = mask[..., None, :, :]
    queries, heads, keys = query.shape[1], query.shape[2], key.shape[1]
    factor = 1.0 / math.sqrt(float(layer._key_dim))
    dtype = getattr(layer._softmax, "compute_dtype", None) or query.dtype

    def probabilities(q, k, mask):
        q = q * engine.ENGINE.cast_scalar(factor, q)
        return layer._masked_softmax(engine.ENGINE.einsum(_flash.SCORES, q, k), mask)

    def decide():
        if not training:
            return None
        ones = engine.ones(query, [heads, queries, keys], dtype)
        dropped = layer._dropout_layer(ones, training=training)
        return engine.pack(dropped != 0)

    bits = _core.kept(decide)
    output = engine.attention(probabilities, query, key, value, mask, bits, rate,
                              _flash.block_rows(queries, keys))
    scores = probabilities(query, key, mask) if scores_asked else None
    return output, scores


def keras_core(core, layer, args, kwargs, scores_asked):
    """`core(layer, *args, **kwargs)` -- Keras's `MultiHeadAttention._compute_attention`
    -- as `recomputed_core`, or None if the call is not the standard case (then
    recompute `core` itself): rank-4 inputs, dropout on with a Python `training`
    flag, no causal mask of Keras's own, no flash attention.

    Returns `(attention_output, attention_scores or None)`.
    """
    if not is_keras_core(core):
        return None
    try:
        bound = inspect.signature(core).bind(layer, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    rate, training = getattr(layer, "_dropout", 0), a["training"]
    if (
        a.get("use_causal_mask") or getattr(layer, "_flash_attention", False)
        or not isinstance(rate, float) or rate <= 0.0 or not isinstance(training, bool)
        or len(query.shape) != 4
        or _gradient_equations(getattr(layer, "_combine_equation", "")) is None
    ):
        return None
    mask = a["attention_mask"]
    equation = layer._dot_product_equation  # "<key>,<query>-><scores>"
    k_sub, q_sub = equation.split("->")[0].split(",")
    query_first = f"{q_sub},{k_sub}->{equation.split('->')[1]}"

    def probabilities(query, key, again):
        query = tf.multiply(query, tf.cast(1.0 / math.sqrt(float(layer._key_dim)), query.dtype))
        # Keras's own order (key first) makes TensorFlow's einsum transpose its
        # [batch, heads, seq, seq] result: query first is the same product without
        # that transpose (measured 3x faster at BERT-base size on CPU), equal to
        # float rounding -- for the recomputation, not for the values returned.
        scores = tf.einsum(query_first, query, key) if again else tf.einsum(equation, key, query)
        probs = layer._masked_softmax(scores, mask)
        return probs, probs

    return recomputed_core(
        probabilities, query, key, value, lambda x: layer._dropout_layer(x, training=training),
        rate, layer._combine_equation, training, scores_asked)
