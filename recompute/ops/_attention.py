"""Keras's `MultiHeadAttention` core as the blocked attention core (`_flash`).

Keras 3 and tf_keras compute a `MultiHeadAttention` layer's core in
`_compute_attention` (the same name in both): scaled scores, the masked
softmax, the dropout, probabilities x values. Keras 3 takes a fused path only
without dropout; with dropout both materialize every [batch, heads, seq, seq]
tensor and autodiff keeps several of them. `keras_blocked` runs the same core
as `_flash`'s blocked core, on the layer's own ops (its scale, masked softmax
and dropout layer), for TensorFlow (`_flash_tf`) or JAX (`_flash_jax`):
`recompute.policies._registry` and `recompute.policies._jax` install it on the attention layers of
every recomputed call, under every policy. bert4keras's core has its own
glue (`recompute.bert4keras._attention`).
"""

import inspect
import math

from ..engine import _core
from . import _flash
from ..adapters import _mha_private as _mha


def attention_layers(adapter, layer):
    """The `MultiHeadAttention` layers of `layer` (itself included) whose cores
    policy="attention" recomputes; a ValueError if there are none.

    `recompute_grad` checks this at a layer's first call, RECOMPUTE on or off
    (the layers may be created in `build`, after the decoration); both engines'
    "attention" policies too.
    """
    layers = adapter.attention_layers(adapter.sublayers(layer))
    if not layers:
        raise ValueError(
            "`recompute_grad(policy='attention')` recomputes the attention core of the "
            f"`MultiHeadAttention` layers ({adapter.name}) that the decorated layer "
            f"contains. Received: layer '{layer.name}', which contains none. Create them in "
            "`__init__` or `build` (as attributes of the layer), or use policy='full'."
        )
    return layers


def with_blocked_cores(fn, cores):
    """`fn` (a call `fn(layer, *args, **kwargs)`) run inside the context `cores()` -- the
    blocked cores installed, and on JAX the feed-forward pairs and gated dropouts -- in the
    forward pass and in the recomputation alike (both engines' "full")."""

    def call(layer, *args, **kwargs):
        with cores():
            return fn(layer, *args, **kwargs)

    return call


def is_keras_core(core):
    """True if `core` is Keras's own `_compute_attention` (Keras 3 or tf_keras), not
    a subclass's."""
    module = getattr(core, "__module__", "") or ""
    return getattr(core, "__name__", None) == _mha.CORE and module.startswith(
        ("keras.", "tf_keras."))


def keras_blocked(engine, core, layer, args, kwargs, scores_asked, policy=None):
    """`core(layer, *args, **kwargs)` -- Keras's `MultiHeadAttention._compute_attention`
    -- as the blocked core of `engine` (`_flash_tf` or `_flash_jax`), or None if
    the call is not the standard case (then the caller runs or recomputes `core`
    itself): rank-4 inputs ([batch, seq, heads, dim]), one attention axis, dropout
    > 0 with a Python `training` flag, no flash attention of Keras's own; and
    only where `_flash.runs_blocked` says so (not in half precision: there
    Keras's own core runs, and gives RECOMPUTE=0's numbers).

    The dropout's decision is drawn once, in the forward pass: the same random
    numbers as RECOMPUTE=0's layer draws, in chunks of rows where the engine can
    (Keras 3's `Dropout`: the engine's `dropout_bits`), else by the
    layer's own dropout layer on ones of the probabilities' shape and dtype; held
    as bits packed along the keys;
    inside a recomputed call it is kept from the forward pass to the
    recomputation (`_core.kept`), not drawn again (in a cut of the batch, on TensorFlow
    under `"full"`, drawn in each pass: the cut's rows of the batch's draw). Keras 3's causal mask
    (`use_causal_mask`) is built as Keras builds it. When the caller uses the
    scores (`scores_asked`; tf_keras always says so), they are the layer's own
    probabilities, computed whole beside the blocked core: in `tf.function`,
    `fit` and `jax.jit` they are pruned when unused.

    `policy`: the recomputation policy the core runs under (`_flash.runs_blocked`'s
    and `_flash.block_rows`'s rule reads it).

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
    rate, training = _mha.dropout_rate(layer), a["training"]
    if (
        _mha.uses_flash_attention(layer)
        or not isinstance(rate, float) or rate <= 0.0 or not isinstance(training, bool)
        or len(query.shape) != 4 or len(key.shape) != 4 or len(value.shape) != 4
        or None in (query.shape[1], key.shape[1], query.shape[2])
        or tuple(_mha.attention_axes(layer) or (1,)) != (1,)
        or not _flash.runs_blocked(engine.ENGINE, query.dtype, query.shape[1], key.shape[1],
                                   policy)
    ):
        return None
    mask = a["attention_mask"]
    if a.get("use_causal_mask"):  # Keras 3: as its own core builds it
        from keras import ops

        causal = _mha.causal_mask(layer, query, value)
        mask = causal if mask is None else ops.logical_and(ops.cast(mask, "bool"), causal)
    while mask is not None and len(mask.shape) < 4:  # as `_masked_softmax` expands it
        mask = mask[..., None, :, :]
    queries, heads, keys = query.shape[1], query.shape[2], key.shape[1]
    rows = _flash.block_rows(queries, keys, engine.ENGINE, policy)
    factor = 1.0 / math.sqrt(float(_mha.key_dim(layer)))
    dtype = getattr(_mha.softmax(layer), "compute_dtype", None) or query.dtype

    def logits(q, k, mask):
        q = q * engine.ENGINE.cast_scalar(factor, q)
        return _mha.masked_logits(layer, engine.ENGINE.einsum(_flash.SCORES, q, k), mask)

    def probabilities(q, k, mask):
        q = q * engine.ENGINE.cast_scalar(factor, q)
        return _mha.masked_softmax(layer, engine.ENGINE.einsum(_flash.SCORES, q, k), mask)

    def decide():
        if not training:
            return None
        bits = engine.dropout_bits(_mha.dropout_layer(layer), query, [heads, queries, keys], dtype,
                                   rows)
        if bits is not None:
            return bits
        dropped = _mha.dropout_layer(layer)(engine.ones(query, [heads, queries, keys], dtype),
                                       training=training)
        return engine.pack(dropped != 0)

    # in a cut of the batch drawn in each pass: kept by cut it weighed more than drawn
    # (seq 2048, 4 blocks: 143.8 against 80.9-95.3 MiB per sample; docs/attention.md)
    bits = _core.kept(decide, in_cuts=False)
    output = engine.attention(logits, query, key, value, mask, bits, rate, rows,
                              _flash.key_block(keys))
    scores = probabilities(query, key, mask) if scores_asked else None
    return output, scores

