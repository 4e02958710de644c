"""The lean attention core: the values of a multi-head attention's core with fewer
[batch, heads, seq, seq] tensors, for the layers it is recomputed in.

An attention core computes `probs = softmax(mask(q k^T / sqrt(d)))`, then
`dropout(probs) @ v`. TensorFlow's autodiff of the dropout and the product keeps
the probabilities, the dropped probabilities (for the gradient of `v`) and the
bool keep-mask, and its gradient runs through the dropout's scaled copy. When
the core is recomputed (`recompute_grad(policy="attention")`; in bert4keras,
under every policy), these tensors are the working set of one layer's
backward pass.
`dropout_then_combine` keeps only the probabilities -- the very tensor the
softmax's own gradient keeps -- and the bool mask, and forms the dropped
probabilities again for the gradient:

- the dropout decision is drawn by the layer's own `Dropout` on a tensor of
  ones, so the random numbers, and the forward values bit for bit, are those
  of the layer's own core (`probs * factor` equals the dropout's
  `where(keep, probs * scale, 0)`);
- the gradient is the one autodiff computes: `where(keep, g * scale, 0)` for
  the dropout, the transposed products for the product.

`lean_core` is Keras's `MultiHeadAttention._compute_attention` (Keras 3 and
tf_keras: the same attribute names) for the standard case -- rank-4 inputs,
dropout on, no causal mask of Keras 3's own; it returns None elsewhere, and
the layer's own core runs. bert4keras's core uses `dropout_then_combine` too
(`recompute.bert4keras._attention`).
"""

import inspect
import math

import tensorflow as tf


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


def dropout_then_combine(probs, value, dropout, equation):
    """`einsum(equation, dropout(probs), value)`, whose gradient keeps `probs` and a
    bool mask only.

    Args:
        probs: the attention probabilities.
        value: the values.
        dropout: `dropout(x)`, the layer's own dropout (None: no dropout).
        equation: the einsum equation of probabilities and values (no index
            summed within one operand).

    Returns:
        The attended values, equal bit for bit to `einsum(equation, dropout(probs),
        value)` for dropout drawing `where(uniform >= rate, x * scale, 0)`.
    """
    d_probs_eq, d_value_eq = _gradient_equations(equation)
    keep = scale = None
    if dropout is not None:
        factor = dropout(tf.ones_like(probs))  # 0 or 1 / (1 - rate); 1 in inference
        keep = tf.not_equal(factor, 0)
        scale = tf.reduce_max(factor)

    def dropped(p):
        return p if keep is None else tf.where(keep, p * scale, tf.zeros([], p.dtype))

    @tf.custom_gradient
    def combine(probs, value):
        def grad(d_out):
            d_value = tf.einsum(d_value_eq, dropped(probs), d_out)  # formed again
            d_dropped = tf.einsum(d_probs_eq, d_out, value)
            d_probs = d_dropped if keep is None else tf.where(
                keep, d_dropped * scale, tf.zeros([], d_dropped.dtype))
            return d_probs, d_value

        return tf.einsum(equation, dropped(probs), value), grad

    return combine(probs, value)


def is_keras_core(core):
    """True if `core` is Keras's own `_compute_attention` (Keras 3 or tf_keras), not
    a subclass's."""
    module = getattr(core, "__module__", "") or ""
    return getattr(core, "__name__", None) == "_compute_attention" and module.startswith(
        ("keras.", "tf_keras."))


def lean_core(core, layer, args, kwargs):
    """`core(layer, *args, **kwargs)` -- a Keras `MultiHeadAttention._compute_attention`
    -- computed with `dropout_then_combine`, or None if the call is not the
    standard case (then run `core` itself).

    Returns `(attention_output, attention_scores)` as Keras's core.
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
    dropout_rate = getattr(layer, "_dropout", 0)
    if (
        a.get("use_causal_mask") or getattr(layer, "_flash_attention", False)
        or not isinstance(dropout_rate, float) or dropout_rate <= 0.0
        or len(query.shape) != 4
        or _gradient_equations(getattr(layer, "_combine_equation", "")) is None
    ):
        return None
    query = tf.multiply(query, tf.cast(1.0 / math.sqrt(float(layer._key_dim)), query.dtype))
    scores = tf.einsum(layer._dot_product_equation, key, query)
    probs = layer._masked_softmax(scores, a["attention_mask"])
    training = a["training"]
    output = dropout_then_combine(
        probs, value, lambda x: layer._dropout_layer(x, training=training), layer._combine_equation)
    return output, probs
