"""The blocked attention core (`_flash`) on Keras 3's JAX backend.

`attention(...)` is one `jax.custom_vjp` whose forward and backward passes are
`_flash.forward` and `_flash.backward`, their blocks a `jax.lax.scan`. Its
residuals are the inputs, the mask and the dropout's bits.
"""

from . import _flash


def pack(mask):
    """A bool [..., keys] mask as [..., ceil(keys / 8)] uint8, 1 bit per entry."""
    import jax.numpy as jnp

    keys = mask.shape[-1]
    flags = mask.astype(jnp.uint8)
    if keys % 8:
        flags = jnp.pad(flags, [(0, 0)] * (mask.ndim - 1) + [(0, -keys % 8)])
    flags = flags.reshape(flags.shape[:-1] + (-(-keys // 8), 8))
    return jnp.sum(flags << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


class _Engine(_flash.Engine):
    def rows(self, x, start, size, axis):
        import jax

        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def pad(self, x, axis, amount, value):
        import jax.numpy as jnp

        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, amount)
        return jnp.pad(x, widths, constant_values=jnp.asarray(value, x.dtype))

    def scan(self, body, carry, n, y_dtype):
        import jax
        import jax.numpy as jnp

        return jax.lax.scan(body, carry, jnp.arange(n))

    def vjp(self, fn, *primals):
        import jax

        return jax.vjp(fn, *primals)

    def einsum(self, equation, a, b):
        import jax.numpy as jnp

        return jnp.einsum(equation, a, b)

    def cast_scalar(self, value, like):
        import jax.numpy as jnp

        return jnp.asarray(value, like.dtype)

    def unpack(self, bits, keys):
        import jax.numpy as jnp

        flags = (bits[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)
        flags = flags.reshape(bits.shape[:-1] + (bits.shape[-1] * 8,)).astype(bool)
        return flags[..., :keys] if keys % 8 else flags

    def drop(self, x, keep, rate):
        import jax
        import jax.numpy as jnp

        # Keras's JAX dropout: select(keep, x / (1 - rate), 0).
        return jax.lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))

    def join(self, ys, rows):
        import jax.numpy as jnp

        moved = jnp.moveaxis(ys, 0, 1)
        joined = moved.reshape((moved.shape[0], -1) + moved.shape[3:])
        return joined if joined.shape[1] == rows else joined[:, :rows]

    def zeros_like(self, x):
        import jax.numpy as jnp

        return jnp.zeros_like(x)

    def length(self, x, axis):
        return x.shape[axis]  # (static under JAX)


ENGINE = _Engine()
NAME = "jax"


def ones(batch_like, shape, dtype):
    """Ones of `[batch of batch_like] + shape` (what the dropout's decision is drawn on)."""
    import jax.numpy as jnp

    return jnp.ones((batch_like.shape[0],) + tuple(shape), dtype)


def attention(probabilities, query, key, value, mask, bits, rate, block):
    """`_flash.forward` as one `jax.custom_vjp` of `query`, `key` and `value`, whose
    gradient is `_flash.backward` (residuals: the inputs, `mask` and `bits`)."""
    import jax

    @jax.custom_vjp
    def core(query, key, value, mask, bits):
        return _flash.forward(ENGINE, probabilities, query, key, value, mask, bits, rate, block)

    def core_fwd(query, key, value, mask, bits):
        return core(query, key, value, mask, bits), (query, key, value, mask, bits)

    def core_bwd(residuals, d_out):
        q, k, v, m, b = residuals
        d_q, d_k, d_v = _flash.backward(ENGINE, probabilities, q, k, v, m, b, rate, block, d_out)
        return d_q, d_k, d_v, _no_gradient(m), _no_gradient(b)

    core.defvjp(core_fwd, core_bwd)
    return core(query, key, value, mask, bits)


def _no_gradient(x):
    """The cotangent of a non-differentiable input of a `custom_vjp` (a mask, bits)."""
    if x is None:
        return None
    import jax
    import jax.numpy as jnp
    import numpy as np

    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
