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

The per-chunk arithmetic (`_step.chunk_step`) is written once in `keras.ops`; the
engines (`_tf`: `tf.custom_gradient` over a `tf.while_loop`;
`_jax`: `jax.custom_vjp` over a `jax.lax.scan`) give the loop, the
custom gradient, three matrix products that do not transpose the kernel
in memory (a [vocabulary, hidden] embedding is 2 GiB at Gemma's size), and the
few ops whose `keras.ops` form would cost TensorFlow [chunk, vocabulary]
temporaries (`argmax`, `pick`, `subtract_at`) or that order reads (`after`).
"""

from ._step import DEFAULT_CHUNK_ELEMENTS, default_chunk_tokens  # noqa: F401


def chunked(h, kernel, targets, weights, *, chunk, cap, vocab_major, grads, kernel_grad):
    """`(loss_sum, hits)` over every token of h [tokens, hidden], `chunk` at a time,
    with the head's gradient (to h, and to `kernel` where `kernel_grad`) when `grads`.
    `hits` [tokens] float32: 1 where the arg-max of the logits is the target."""
    import keras

    if keras.backend.backend() == "jax":
        from . import _jax as engine
    else:
        from . import _tf as engine
    return engine.chunked(h, kernel, targets, weights, chunk=chunk, cap=cap,
                          vocab_major=vocab_major, grads=grads, kernel_grad=kernel_grad)
