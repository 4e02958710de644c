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
custom gradient and three matrix products that do not transpose the kernel
in memory (a [vocabulary, hidden] embedding is 2 GiB at Gemma's size).
"""

DEFAULT_CHUNK_ELEMENTS = 1 << 26  # one chunk's logits: 256 MiB in float32 (docs/keras_hub.md)


def default_chunk_tokens(vocabulary):
    """The tokens of one chunk by default: logits of at most `DEFAULT_CHUNK_ELEMENTS`
    entries, a multiple of 8 (256 tokens at Gemma's 256,000 words), at least 8."""
    return max(8, (DEFAULT_CHUNK_ELEMENTS // max(1, int(vocabulary))) // 8 * 8)


def chunk_step(engine, h, kernel, targets, weights, *, cap, vocab_major, grads, kernel_grad):
    """One chunk: `(loss_sum, hits, dh, dkernel)` (the last two None without `grads`;
    `dkernel` None without `kernel_grad`).

    h [c, hidden] and `kernel` in the head's compute dtype; `kernel` [vocabulary,
    hidden] when `vocab_major` (a tied embedding) else [hidden, vocabulary]; targets
    [c] int; weights [c] float32 (the loss is `sum(weights * per-token loss)`).
    """
    from keras import ops

    z = engine.matmul(h, kernel, transpose_b=vocab_major)  # [c, V], compute dtype
    if cap is not None:  # keras-hub's ReversibleEmbedding: in the compute dtype
        z = ops.multiply(ops.tanh(ops.divide(z, cap)), cap)
    hits = ops.cast(ops.equal(ops.cast(ops.argmax(z, axis=-1), "int32"), targets), "float32")
    s = ops.cast(z, "float32")  # Keras's loss computes in float32
    top = ops.stop_gradient(ops.max(s, axis=-1, keepdims=True))
    e = ops.exp(s - top)
    total = ops.sum(e, axis=-1, keepdims=True)
    lse = (top + ops.log(total))[:, 0]
    target_logit = ops.take_along_axis(s, targets[:, None], axis=-1)[:, 0]
    loss_sum = ops.sum(weights * (lse - target_logit))
    if not grads:
        return loss_sum, hits, None, None
    vocabulary = ops.shape(s)[-1]
    dz = (e / total - ops.one_hot(targets, vocabulary, dtype="float32")) * weights[:, None]
    if cap is not None:
        dz = dz * (1.0 - ops.square(s / cap))
    dz = ops.cast(dz, h.dtype)
    if vocab_major:  # kernel [V, hidden]: dh = dz K, dK = dz^T h
        dh = engine.matmul(dz, kernel)
        dkernel = engine.matmul(dz, h, transpose_a=True) if kernel_grad else None
    else:  # kernel [hidden, V]: dh = dz K^T, dK = h^T dz
        dh = engine.matmul(dz, kernel, transpose_b=True)
        dkernel = engine.matmul(h, dz, transpose_a=True) if kernel_grad else None
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
