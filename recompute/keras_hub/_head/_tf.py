"""The chunked head (`recompute.keras_hub._head`) on Keras 3's TensorFlow backend: a `tf.while_loop` over
chunks (the number of tokens may be known only when the step runs), inside a
`tf.custom_gradient` in training: the forward pass forms the head's gradients
chunk by chunk, the backward pass scales them by the incoming gradient. In
evaluation the loop computes the loss and the hits only."""

from . import _step


class _Engine:
    name = "tensorflow"

    @staticmethod
    def matmul(a, b, transpose_a=False, transpose_b=False):
        import tensorflow as tf

        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)

    @staticmethod
    def argmax(x):
        """The column of x [rows, n]'s first maximum in each row, int32 [rows] (Keras's
        `ops.argmax` makes two [rows, n] temporaries on TensorFlow to order -0.0 below
        0.0; here they tie)."""
        import tensorflow as tf

        return tf.argmax(x, axis=-1, output_type=tf.int32)

    @staticmethod
    def pick(x, columns):
        """x [rows, n] at (i, columns[i]): [rows]."""
        import tensorflow as tf

        return tf.gather(x, columns[:, None], batch_dims=1)[:, 0]

    @staticmethod
    def subtract_at(x, columns, value):
        """x [rows, n] less `value` at (i, columns[i]), written into x's buffer: x must
        have no other reader (a tensor made for this call), for it is overwritten.

        `tensor_scatter_nd_sub` copies its input; `InplaceSub` on x seen as [rows * n, 1]
        does not. The copy where XLA compiles (no `InplaceSub` kernel there; XLA places
        buffers itself), where x's shape is not static, or where rows * n passes
        `InplaceSub`'s int32 index."""
        import tensorflow as tf

        rows, n = x.shape
        columns = tf.cast(columns, tf.int32)
        if rows is None or n is None or rows * n >= 2**31 or _in_xla():
            index = tf.stack([tf.range(tf.shape(x)[0]), columns], axis=1)
            updates = tf.fill(tf.shape(columns), tf.constant(value, x.dtype))
            return tf.tensor_scatter_nd_sub(x, index, updates)
        flat = tf.range(rows) * n + columns
        updates = tf.fill([rows, 1], tf.constant(value, x.dtype))
        y = tf.raw_ops.InplaceSub(x=tf.reshape(x, [-1, 1]), i=flat, v=updates)
        return tf.reshape(y, [rows, n])

    @staticmethod
    def after(x, *ops):
        """x, read only once `ops` have run (a control dependency): so that the reader of
        the result may reuse x's buffer, its other readers being done."""
        import tensorflow as tf

        with tf.control_dependencies(ops):
            return tf.identity(x)


ENGINE = _Engine()


def _in_xla():
    """Whether the graph being built is compiled by XLA (`recompute.adapters._tf`, the interface
    to TensorFlow's private names)."""
    from ...adapters import _tf

    return _tf.in_xla_context()


def _run(h, kernel, targets, weights, chunk, with_grads, with_dk, options):
    """`(loss, hits, dh, dk)` over every chunk of h in one `tf.while_loop` (dh, dk 0 where
    not asked for)."""
    import tensorflow as tf

    hidden = h.shape[-1]
    tokens = tf.shape(h)[0]
    n = (tokens + chunk - 1) // chunk
    pad = n * chunk - tokens

    def split(x):
        x = tf.pad(x, [[0, pad]] + [[0, 0]] * (x.shape.rank - 1))
        return tf.reshape(x, tf.concat([[n, chunk], tf.shape(x)[1:]], axis=0))

    hs, ts, ws = split(h), split(targets), split(weights)
    hits0 = tf.TensorArray(tf.float32, size=n, element_shape=[chunk])
    dh0 = tf.TensorArray(h.dtype, size=n, element_shape=[chunk, hidden]) if with_grads else 0
    dk0 = tf.zeros_like(kernel) if with_dk else 0

    def body(i, loss, hits, dh, dk):
        loss_c, hits_c, dh_c, dk_c = _step.chunk_step(
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


def chunked(h, kernel, targets, weights, *, chunk, cap, vocab_major, grads, kernel_grad):
    import tensorflow as tf

    static_tokens = h.shape[0]
    if static_tokens is not None:
        chunk = max(1, min(chunk, int(static_tokens)))
    options = dict(cap=cap, vocab_major=vocab_major)

    def run(h, kernel, with_grads):
        return _run(h, kernel, targets, weights, chunk, with_grads,
                    with_grads and kernel_grad, options)

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
