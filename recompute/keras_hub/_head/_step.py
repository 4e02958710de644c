"""One chunk of the chunked head (`recompute.keras_hub._head`), written once in
`keras.ops` for both engines: `chunk_step`, and the default chunk size."""


DEFAULT_CHUNK_ELEMENTS = 1 << 27  # one chunk's logits: 512 MiB in float32 (docs/keras_hub.md)


def default_chunk_tokens(vocabulary):
    """The tokens of one chunk by default: logits of at most `DEFAULT_CHUNK_ELEMENTS`
    entries, a multiple of 8 (520 tokens at Gemma's 256,000 words), at least 8."""
    return max(8, (DEFAULT_CHUNK_ELEMENTS // max(1, int(vocabulary))) // 8 * 8)


def chunk_step(engine, h, kernel, targets, weights, *, cap, vocab_major, grads, kernel_grad):
    """One chunk: `(loss_sum, hits, dh, dkernel)` (the last two None without `grads`;
    `dkernel` None without `kernel_grad`).

    h [c, hidden] and `kernel` in the head's compute dtype; `kernel` [vocabulary,
    hidden] when `vocab_major` (a tied embedding) else [hidden, vocabulary]; targets
    [c] int in [0, vocabulary); weights [c] float32 (the loss is `sum(weights *
    per-token loss)`).

    Written for TensorFlow's graph executor, which materializes every op's output but
    lets an elementwise op write into an input that has no other reader left: the
    [c, vocabulary] float32 tensors alive at once are one (the logits, then their
    exponentials, then dL/dz, in the same buffer) without a soft cap and in float32,
    two with a cap (the capped logits stay for the cap's derivative) or a compute dtype
    other than float32 (the logits and their float32 copy). The per-token weights
    scale the [c, hidden] side (`dh = w * (dz K)`, `dK = dz^T (w * h)`), the one-hot
    targets are subtracted in place (`engine.subtract_at`), and `engine.after` orders
    the logits' last readers (arg-max, target logit, max) before the one that reuses them.
    """
    from keras import ops

    z = engine.matmul(h, kernel, transpose_b=vocab_major)  # [c, V], compute dtype
    if cap is not None:  # keras-hub's ReversibleEmbedding: in the compute dtype
        z = ops.multiply(ops.tanh(ops.divide(z, cap)), cap)
    hits = ops.cast(ops.equal(engine.argmax(z), ops.cast(targets, "int32")), "float32")
    s = ops.cast(z, "float32")  # Keras's loss computes in float32
    top = ops.stop_gradient(ops.max(s, axis=-1, keepdims=True))
    target_logit = engine.pick(s, targets)
    keep_s = grads and cap is not None  # the cap's derivative reads s after the softmax
    e = ops.exp(ops.subtract(s if keep_s else engine.after(s, hits, target_logit), top))
    total = ops.sum(e, axis=-1, keepdims=True)
    lse = (top + ops.log(total))[:, 0]
    loss_sum = ops.sum(weights * (lse - target_logit))
    if not grads:
        return loss_sum, hits, None, None
    dz = engine.subtract_at(ops.multiply(e, ops.reciprocal(total)), targets, 1.0)
    if cap is not None:  # d s / d z = 1 - (s / cap)^2, in s's buffer once its other readers ran
        s = engine.after(s, hits, target_logit, total)
        dz = ops.multiply(dz, ops.subtract(1.0, ops.square(ops.divide(s, cap))))
    dz = ops.cast(dz, h.dtype)
    w = ops.cast(weights, h.dtype)[:, None]
    if vocab_major:  # kernel [V, hidden]: dh = w (dz K), dK = dz^T (w h)
        dh = ops.multiply(engine.matmul(dz, kernel), w)
        dkernel = engine.matmul(dz, ops.multiply(h, w), transpose_a=True) if kernel_grad else None
    else:  # kernel [hidden, V]: dh = w (dz K^T), dK = (w h)^T dz
        dh = ops.multiply(engine.matmul(dz, kernel, transpose_b=True), w)
        dkernel = engine.matmul(ops.multiply(h, w), dz, transpose_a=True) if kernel_grad else None
    return loss_sum, hits, dh, dkernel
