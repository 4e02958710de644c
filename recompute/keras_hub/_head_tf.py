"""The chunked head (`_head`) on Keras 3's TensorFlow backend: a `tf.while_loop` over
chunks (the number of tokens may be known only when the step runs), inside a
`tf.custom_gradient` in training: the forward pass forms the head's gradients
chunk by chunk, the backward pass scales them by the incoming gradient. In
evaluation the loop computes the loss and the hits only."""

from . import _head


class _Engine:
    name = "tensorflow"

    @staticmethod
    def matmul(a, b, transpose_a=False, transpose_b=False):
        import tensorflow as tf

        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


ENGINE = _Engine()


def chunked(h, kernel, targets, weights, *, chunk, cap, vocab_major, grads, kernel_grad):
    import tensorflow as tf

    static_tokens = h.shape[0]
    if static_tokens is not None:
        chunk = max(1, min(chunk, int(static_tokens)))
    hidden = h.shape[-1]
    tokens = tf.shape(h)[0]
    n = (tokens + chunk - 1) // chunk
    pad = n * chunk - tokens
    options = dict(cap=cap, vocab_major=vocab_major)

    def split(x):
        x = tf.pad(x, [[0, pad]] + [[0, 0]] * (x.shape.rank - 1))
        return tf.reshape(x, tf.concat([[n, chunk], tf.shape(x)[1:]], axis=0))

    def run(h, kernel, with_grads):
        hs, ts, ws = split(h), split(targets), split(weights)
        with_dk = with_grads and kernel_grad
        hits0 = tf.TensorArray(tf.float32, size=n, element_shape=[chunk])
        dh0 = tf.TensorArray(h.dtype, size=n, element_shape=[chunk, hidden]) if with_grads else 0
        dk0 = tf.zeros_like(kernel) if with_dk else 0

        def body(i, loss, hits, dh, dk):
            loss_c, hits_c, dh_c, dk_c = _head.chunk_step(
                ENGINE, hs[i], kernel, ts[i], ws[i], grads=with_grads,
                kernel_grad=with_dk, **options)
            hits = hits.write(i, hits_c)
            if with_grads:
                dh = dh.write(i, dh_c)
            if with_dk:
                dk = dk + dk_c
            return i + 1, loss + loss_c, hits, dh, dk

        _, loss, hits, dh, dk = tf.while_loop(
            lambda i, *_: i < n, body, (0, tf.zeros((), tf.float32), hits0, dh0, dk0),
            parallel_iterations=1)
        hits = tf.reshape(hits.stack(), [-1])[:tokens]
        if with_grads:
            dh = tf.reshape(dh.stack(), [-1, hidden])[:tokens]
        return loss, hits, dh, dk

    if not grads:
        loss, hits, _, _ = run(h, kernel, False)
        return loss, hits

    if kernel_grad:
        @tf.custom_gradient
        def head(h, kernel):
            loss, hits, dh, dk = run(h, kernel, True)

            def grad(g_loss, g_hits):
                return dh * tf.cast(g_loss, dh.dtype), dk * tf.cast(g_loss, dk.dtype)

            return (loss, hits), grad

        return head(h, kernel)

    kernel = tf.stop_gradient(kernel)

    @tf.custom_gradient
    def head_frozen(h):
        loss, hits, dh, _ = run(h, kernel, True)

        def grad(g_loss, g_hits):
            return dh * tf.cast(g_loss, dh.dtype)

        return (loss, hits), grad

    return head_frozen(h)
