"""The lean attention core, used while patched with recomputation on: bert4keras's
`pay_attention_to` with fewer [batch, heads, seq, seq] tensors.

bert4keras computes the attention probabilities as
`A = dropout(softmax(where(mask, (q k^T) / sqrt(d), -inf)))` and lets
TensorFlow's autodiff take the gradient: the backward pass then holds the
scores, the scaled scores, the masked scores, the softmax, the dropout's
uniform draw, its scaled copy and its result, and as many gradients, all
[batch, heads, seq, seq] float32. With recomputation on, the core is
recomputed in the backward pass one layer (or block) at a time -- alone under
`patch(policy="attention")` -- so these tensors are the working set of one
layer's backward pass, on top of everything the model keeps.
`lean_pay_attention_to` computes the same values with fewer of them:

- the scale is folded into the queries (`q / sqrt(d)` is [batch, seq, heads,
  d], not [.., seq, seq]; exact when `d` is a power of 4, as 64 is);
- the padding mask is an additive [batch, 1, 1, seq] bias of 0 and -inf
  (`a + bias` equals `where(mask, a, -inf)` bit for bit);
- the dropout and `probabilities x values` are the package's lean product
  (`recompute._attention.dropout_then_combine`): bert4keras's own `Dropout`
  layer drops the probabilities, so the random numbers and values are those
  of `RECOMPUTE=0`; its decision is kept as bits (1 bit per entry),
  and the dropped probabilities are formed again for the gradient. The
  softmax's gradient reads its output, which that product keeps anyway;
- under `patch(policy="attention")` the core is one unit
  (`recomputed_pay_attention_to`) that keeps its inputs and those bits:
  the backward pass recomputes the scores and the softmax, not the dropout's
  random numbers (the costliest part of the core on CPU). Under "layer" and
  "block" the core is recomputed with its layer or block, and the bits
  are kept through that recomputation (`recompute._core.kept`), not redrawn.

Only the standard case is lean: softmax normalization, no attention bias, no
position bias. `lean_applies` says whether a call is; every other call runs
bert4keras's own code (recomputed all the same).
"""

import tensorflow as tf

from .. import _attention as shared

SCORES_EINSUM = "bjhd,bkhd->bhjk"  # queries x keys, as bert4keras writes it
P_EINSUM = "bhjk,bkhd->bjhd"  # probabilities x values, as bert4keras writes it


def lean_applies(layer, inputs, kwargs):
    """True if `layer.pay_attention_to(inputs, mask, **kwargs)` is the standard case."""
    return (
        getattr(layer, "normalization", None) == "softmax"
        and not kwargs.get("a_bias")
        and not kwargs.get("p_bias")
        and len(inputs) == 3
    )


def _probabilities(layer, mask):
    """`(qw, kw) -> (probs, a)` of bert4keras's core: the softmax and the scaled scores."""
    v_mask = mask[1] if mask is not None else None

    def probabilities(qw, kw, again=False):  # (`again`: the same ops either way)
        if layer.attention_scale:
            qw = qw * tf.cast(layer.key_size ** -0.5, qw.dtype)
        a = tf.einsum(SCORES_EINSUM, qw, kw)
        if v_mask is None:
            return tf.nn.softmax(a, axis=-1), a
        keys = tf.cast(v_mask, tf.bool)[:, None, None, :]
        bias = tf.where(keys, tf.zeros([], a.dtype), tf.constant(-float("inf"), a.dtype))
        return tf.nn.softmax(a + bias, axis=-1), a

    return probabilities


def lean_pay_attention_to(layer, inputs, mask, dropout):
    """bert4keras's `pay_attention_to(inputs, mask)` for the standard case
    (`lean_applies`), computed as the module docstring says, with a gradient that
    keeps the softmax output and the dropout's bits (inside a recomputed layer or block).

    Args:
        layer: the bert4keras attention layer (its `key_size`,
            `attention_scale`, `attention_dropout`).
        inputs: `[qw, kw, vw]`, [batch, seq, heads, size] each.
        mask: `[q_mask, v_mask]` (either may be None).
        dropout: `dropout(rate)`, returning the `Dropout` layer bert4keras
            would create here.

    Returns:
        `(o, a)` as bert4keras: the attended values [batch, seq, heads, size]
        and the (scaled, unmasked) scores [batch, heads, seq, seq].
    """
    qw, kw, vw = inputs
    probs, a = _probabilities(layer, mask)(qw, kw)
    rate = layer.attention_dropout
    o = shared.dropout_then_combine(probs, vw, dropout(rate) if rate else None, rate, P_EINSUM)
    return o, a


def recomputed_pay_attention_to(layer, inputs, mask, dropout, scores_asked):
    """The same under `patch(policy="attention")` with a tape recording: a unit that
    keeps its inputs and the dropout's bits and recomputes the softmax for
    the gradient (`recompute._attention.recomputed_core`). Returns `(o, a or None)`."""
    qw, kw, vw = inputs
    rate = layer.attention_dropout
    return shared.recomputed_core(_probabilities(layer, mask), qw, kw, vw,
                                  dropout(rate) if rate else None, rate, P_EINSUM,
                                  second_asked=scores_asked)
