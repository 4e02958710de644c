"""The chunked language-model head and loss: one algorithm, two engines.

A keras-hub causal LM's head is its token embedding reversed: logits
`z = h K` (K the tied embedding's transpose, [hidden, vocabulary], or an
untied `reverse_embeddings`), soft-capped `s = c tanh(z / c)` where the model
has a final-logit soft cap, then Keras's `SparseCategoricalCrossentropy
(from_logits=True)`: per token `lse(s) - s[target]`, weighted and reduced.

`chunked(...)` does this for `chunk` tokens at a time and keeps per token only
the weighted loss's sum and whether the arg-max is the target (the weighted
accuracy metric); never a [tokens, vocabulary] tensor beyond one chunk's. In
training the gradients are formed in the same pass, chunk by chunk, as
PyTorch's fused linear-cross-entropy losses (Liger-Kernel) do: the loss is
linear in the per-token weights `w`, which are known in the forward pass, so

    dL/dz = w * (softmax(s) - onehot(target)) * (1 - (s / c)^2)
    dL/dh = dL/dz K^T,      dL/dK = h^T dL/dz (summed over the chunks)

and the backward pass only scales them by the incoming gradient (the loss
scale of mixed precision, or 1): the head's three matrix products, as the
full-logit step has, and nothing multiplied twice. `dL/dK` is formed only
where the head's kernel is trained (`kernel_grad`; LoRA freezes it).

The per-chunk arithmetic (`chunk_step`) is written once in `keras.ops`; the
engines (`_head_tf`: `tf.custom_gradient` over a `tf.while_loop`;
`_head_jax`: `jax.custom_vjp` over a `jax.lax.scan`) give the loop, the
custom gradient, three matrix products that do not transpose the kernel
in memory (a [vocabulary, hidden] embedding is 2 GiB at Gemma's size), and the
few ops whose `keras.ops` form would cost TensorFlow [chunk, vocabulary]
temporaries (`argmax`, `pick`, `subtract_at`) or that order reads (`after`).
"""

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


def chunked(h, kernel, targets, weights, *, chunk, cap, vocab_major, grads, kernel_grad):
    """`(loss_sum, hits)` over every token of h [tokens, hidden], `chunk` at a time,
    with the head's gradient (to h, and to `kernel` where `kernel_grad`) when `grads`.
    `hits` [tokens] float32: 1 where the arg-max of the logits is the target."""
    import keras

    if keras.backend.backend() == "jax":
        from . import _head_jax as engine
    else:
        from . import _head_tf as engine
    return engine.chunked(h, kernel, targets, weights, chunk=chunk, cap=cap,
                          vocab_major=vocab_major, grads=grads, kernel_grad=kernel_grad)
