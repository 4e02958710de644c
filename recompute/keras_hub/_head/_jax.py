"""The chunked head (`recompute.keras_hub._head`) on Keras 3's JAX backend: one `jax.custom_vjp` over a
`jax.lax.scan` of chunks. Its primal (evaluation, or a forward pass nobody
differentiates) computes the loss and the hits only; its forward pass under
differentiation also forms the head's gradients, chunk by chunk, and keeps them as
the residuals (dL/dh, the size of h, and dL/dK where the kernel trains), which the
backward pass scales by the incoming gradient."""

from . import _step


class _Engine:
    name = "jax"

    @staticmethod
    def matmul(a, b, transpose_a=False, transpose_b=False):
        import jax

        dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
        return jax.lax.dot_general(a, b, dims)

    @staticmethod
    def argmax(x):
        """The column of x [rows, n]'s first maximum in each row, int32 [rows]."""
        import jax.numpy as jnp

        return jnp.argmax(x, axis=-1).astype("int32")

    @staticmethod
    def pick(x, columns):
        """x [rows, n] at (i, columns[i]): [rows]."""
        import jax.numpy as jnp

        return jnp.take_along_axis(x, columns[:, None], axis=-1)[:, 0]

    @staticmethod
    def subtract_at(x, columns, value):
        """x [rows, n] less `value` at (i, columns[i]) (XLA updates in place)."""
        import jax.numpy as jnp

        return x.at[jnp.arange(x.shape[0]), columns].add(-value)

    @staticmethod
    def after(x, *ops):
        """x (XLA schedules buffers itself: no ordering needed)."""
        return x


ENGINE = _Engine()


def _split(x, chunk, n):
    """x [tokens, ...] padded with zeros to n * chunk tokens, as [n, chunk, ...]."""
    import jax.numpy as jnp

    pad = n * chunk - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((n, chunk) + x.shape[1:])


def chunked(h, kernel, targets, weights, *, chunk, cap, vocab_major, grads, kernel_grad):
    import jax
    import jax.numpy as jnp

    tokens = h.shape[0]
    chunk = max(1, min(chunk, tokens))
    n = -(-tokens // chunk)
    options = dict(cap=cap, vocab_major=vocab_major, kernel_grad=kernel_grad)

    def run(h, kernel, targets, weights, with_grads):
        xs = (_split(h, chunk, n), _split(targets, chunk, n), _split(weights, chunk, n))
        dk0 = jnp.zeros(kernel.shape, kernel.dtype) if with_grads and kernel_grad else None

        def body(carry, x):
            loss, dk = carry
            loss_c, hits_c, dh_c, dk_c = _step.chunk_step(
                ENGINE, x[0], kernel, x[1], x[2], grads=with_grads, **options)
            if dk_c is not None:
                dk = dk + dk_c
            return (loss + loss_c, dk), (hits_c, dh_c)

        (loss, dk), (hits, dh) = jax.lax.scan(body, (jnp.zeros((), "float32"), dk0), xs)
        hits = hits.reshape(-1)[:tokens]
        if dh is not None:
            dh = dh.reshape((n * chunk,) + h.shape[1:])[:tokens]
        return loss, hits, dh, dk

    @jax.custom_vjp
    def head(h, kernel, targets, weights):
        loss, hits, _, _ = run(h, kernel, targets, weights, False)
        return loss, hits

    def forward(h, kernel, targets, weights):
        loss, hits, dh, dk = run(h, kernel, targets, weights, True)
        return (loss, hits), (dh, dk)

    def backward(residuals, cotangents):
        dh, dk = residuals
        g = cotangents[0]
        dh = dh * g.astype(dh.dtype)
        dk = dk * g.astype(dk.dtype) if dk is not None else None
        return dh, dk, None, None

    head.defvjp(forward, backward)
    if not grads:
        loss, hits, _, _ = run(h, kernel, targets, weights, False)
        return loss, hits
    return head(h, kernel if kernel_grad else jax.lax.stop_gradient(kernel), targets, weights)
