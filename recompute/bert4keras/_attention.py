"""The blocked attention core (`recompute.ops._flash`) for bert4keras's `pay_attention_to`,
used while patched with recomputation on, under every policy.

bert4keras computes the attention probabilities as
`A = dropout(softmax(where(mask, (q k^T) / sqrt(d), -inf)))` and lets
TensorFlow's autodiff take the gradient: the backward pass then holds the
scores, the scaled scores, the masked scores, the softmax, the dropout's
uniform draw, its scaled copy and its result, and as many gradients, all
[batch, heads, seq, seq] float32. `lean_pay_attention_to` computes the same
values as the blocked core, one block of query rows at a time, forward and
backward (docs/attention.md):

- the scale is folded into the queries (`q / sqrt(d)` is [batch, seq, heads,
  d], not [.., seq, seq]; exact when `d` is a power of 4, as 64 is);
- the padding mask is an additive [batch, 1, 1, seq] bias of 0 and -inf
  (`a + bias` equals `where(mask, a, -inf)` bit for bit); an attention bias
  (`a_bias`: the language model's causal mask) is cut into the blocks' rows
  and applied as bert4keras's `sequence_masking` applies it;
- under `patch(policy="attention")` it is one unit of its own (a custom gradient
  keeps its inputs); under the other policies it is recomputed with its layer
  or block;
- the dropout's decision is drawn once by bert4keras's own `Dropout` layer (on
  ones of the probabilities' shape: the random numbers of `RECOMPUTE=0`) and
  kept as bits (1 bit per entry); under "layer" and "block" it is kept through
  the recomputation of the layer or block (`recompute.engine.kept`), not redrawn.

Only the standard case is blocked: softmax normalization, no position bias,
and not in half precision, and under `attention_core("auto")` beyond 512 keys
only, or under `policy="attention"` (`recompute.ops._flash.runs_blocked`, the rule Keras's
cores follow too).
`lean_applies` says whether a call is; every other call runs bert4keras's own
code (recomputed all the same).
"""

import tensorflow as tf

from .. import engine
from ..ops import _flash, _flash_tf

SCORES_EINSUM = "bjhd,bkhd->bhjk"  # queries x keys, as bert4keras writes it
P_EINSUM = "bhjk,bkhd->bjhd"  # probabilities x values, as bert4keras writes it
_ONE_ENTRY_RATE = 1e-6  # from this rate, 1 / (1 - rate) is above 1 in float32 (the core's
# dtypes: float32 and float64; not half precision)


def lean_applies(layer, inputs, kwargs, policy=None):
    """True if `layer.pay_attention_to(inputs, mask, **kwargs)` is the standard case:
    softmax, no position bias; an attention bias (`a_bias`: the language model's
    causal mask, UniLM's) is supported; and `recompute.ops._flash.runs_blocked` says
    the blocked core runs (not in half precision: there bert4keras's own code
    runs, recomputed, as for Keras's core; under "auto" beyond 512 keys, and under
    `policy="attention"` or `"block"` (the patch's whole-block policies) up to 512 keys
    too)."""
    return (
        getattr(layer, "normalization", None) == "softmax"
        and not kwargs.get("p_bias")
        and len(inputs) == (4 if kwargs.get("a_bias") else 3)
        and _flash.runs_blocked(_flash_tf.ENGINE, inputs[0].dtype, inputs[0].shape[1],
                                inputs[1].shape[1], policy)
    )


def _aligned_bias(inputs):
    """The attention bias of `inputs` (`a_bias`, bool or float) as rank 4, or None."""
    if len(inputs) < 4:
        return None
    bias = inputs[3]
    if bias.shape.rank == 3:  # as bert4keras aligns it: [batch, 1, queries, keys]
        return bias[:, None]
    while bias.shape.rank < 4:
        bias = bias[None]
    return bias


def _masks(inputs, mask):
    """The masks `_logits` takes, cut into blocks by the core: `(a_bias, keys)`, the
    attention bias as rank 4 (or None) and the keys' padding as bool [batch, 1, 1, keys]
    (or None)."""
    v_mask = mask[1] if mask is not None else None
    keys = None if v_mask is None else tf.cast(v_mask, tf.bool)[:, None, None, :]
    return (_aligned_bias(inputs), keys)


def _logits(layer):
    """`(qw, kw, masks) -> (logits, None)` of bert4keras's core for a block of queries and
    keys: what its softmax takes -- the scale folded into the queries, the keys' padding an
    additive bias of 0 and -inf, the attention bias (`_masks`) as bert4keras's
    `sequence_masking` applies it."""

    def logits(qw, kw, masks):
        a_bias, keys = masks
        a = tf.einsum(SCORES_EINSUM, _scaled(layer, qw), kw)
        if keys is not None:
            a = a + tf.where(keys, tf.zeros([], a.dtype), tf.constant(-float("inf"), a.dtype))
        if a_bias is not None:  # as bert4keras's `sequence_masking`
            a = tf.where(a_bias, a, tf.constant(-float("inf"), a.dtype)) \
                if a_bias.dtype == tf.bool else a + tf.cast(a_bias, a.dtype)
        return a, None

    return logits


def _scaled(layer, qw):
    return qw * tf.cast(layer.key_size ** -0.5, qw.dtype) if layer.attention_scale else qw


def _decision(layer, qw, kw, dropout):
    """`(bits, rate)`: the dropout's decision, drawn by bert4keras's own `Dropout` layer on
    ones of the probabilities' shape, as bits; `rate` is 0 where it did not run (inference)."""
    rate = layer.attention_dropout
    if not rate:
        return None, 0.0
    shape = tf.stack([tf.shape(qw)[2], tf.shape(qw)[1], tf.shape(kw)[1]])
    ones = _flash_tf.ones(qw, shape, qw.dtype)
    dropped = dropout(rate)(ones)
    # In training every entry is 0 or 1 / (1 - rate), never 1 (for rates from
    # `_ONE_ENTRY_RATE`; below it, a scale that rounds to 1 is possible): one entry says
    # whether the dropout ran, where comparing every entry is one more pass over them.
    seen = dropped[:1, :1, :1, :1] if rate >= _ONE_ENTRY_RATE else dropped
    ran = tf.reduce_any(tf.not_equal(seen, tf.ones([], dropped.dtype)))
    return _flash_tf.pack(tf.not_equal(dropped, tf.zeros([], dropped.dtype))), \
        tf.where(ran, tf.constant(rate, tf.float32), 0.0)


def lean_pay_attention_to(layer, inputs, mask, dropout, scores_asked=True, policy=None):
    """bert4keras's `pay_attention_to(inputs, mask)` for the standard case
    (`lean_applies`) as the blocked attention core (`recompute.ops._flash_tf`): it keeps
    its inputs and the dropout's bits, and holds one block of [.., seq, seq] floats
    at a time, forward and backward.

    Args:
        layer: the bert4keras attention layer (its `key_size`,
            `attention_scale`, `attention_dropout`).
        inputs: `[qw, kw, vw]`, [batch, seq, heads, size] each (and the attention
            bias, with `a_bias=True`).
        mask: `[q_mask, v_mask]` (either may be None).
        dropout: `dropout(rate)`, returning the `Dropout` layer bert4keras
            would create here.
        scores_asked: whether the caller uses the scores (else None is returned).
        policy: the policy it runs under ("attention", and "block": bert4keras's
            whole-block policies, as the patch passes it: one block of every row up to
            512 keys, `recompute.ops._flash.block_rows`).

    Returns:
        `(o, a)` as bert4keras: the attended values [batch, seq, heads, size]
        and the (scaled, unmasked) scores [batch, heads, seq, seq] (computed
        whole, when asked: in a `tf.function` they are pruned when unused).
    """
    qw, kw, vw = inputs[:3]
    bits, rate = engine.kept(lambda: _decision(layer, qw, kw, dropout))
    queries, keys = qw.shape[1], kw.shape[1]
    block = None if None in (queries, keys) else _flash.block_rows(queries, keys, _flash_tf.ENGINE,
                                                                   policy)
    o = _flash_tf.attention(_logits(layer), qw, kw, vw, _masks(inputs, mask), bits, rate, block,
                            _flash.key_block(keys))
    a = tf.einsum(SCORES_EINSUM, _scaled(layer, qw), kw) if scores_asked else None
    return o, a
