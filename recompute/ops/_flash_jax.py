"""The blocked attention core (`_flash`) on Keras 3's JAX backend.

`attention(...)` is one `jax.custom_vjp` whose forward and backward passes are
`_flash.forward` and `_flash.backward`, their blocks a loop (`scan_after`: a
`jax.lax.fori_loop` whose buffers are made after the call's inputs, so that
XLA cannot make every layer's at the start of the step). Its residuals are
the inputs, the mask and the dropout's bits.

`keep_bits(...)` draws the decision of Keras's JAX `Dropout` as those bits one
block of rows at a time (issue 25): the whole draw, [batch, heads, seq, seq]
random uint32 with its floats, was otherwise the one [seq, seq]-sized value
of the blocked step, left to XLA's fusion (XLA:CPU's threefry loop holds
several uint32 tensors of that size; whether the GPU fused it is unmeasured),
and under `"full"` it is drawn again in the recomputation (docs/attention.md,
"On JAX").
"""

from . import _flash
from ..engine._jax import scan_after, zero_after  # (their home: the JAX engine)


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
    name = "jax"

    def rows(self, x, start, size, axis):
        import jax

        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def pad(self, x, axis, amount, value):
        import jax.numpy as jnp

        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, amount)
        return jnp.pad(x, widths, constant_values=jnp.asarray(value, x.dtype))

    def scan(self, body, carry, n, y_dtypes, anchor):
        return scan_after(body, carry, n, anchor)

    def chain(self, tensors, gate):
        import jax

        tensors, gate = jax.lax.optimization_barrier((list(tensors), list(gate)))
        return list(tensors), list(gate)

    def vjp(self, fn, *primals):
        import jax

        out, pullback, aux = jax.vjp(fn, *primals, has_aux=True)
        return out, aux, pullback

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

    def join(self, ys, rows, axis):
        import jax.numpy as jnp

        moved = jnp.moveaxis(ys, 0, axis)
        joined = moved.reshape(moved.shape[:axis] + (-1,) + moved.shape[axis + 2:])
        if joined.shape[axis] == rows:
            return joined
        return jax_rows(joined, 0, rows, axis)

    def zeros_like(self, x, after):
        import jax.numpy as jnp

        # made after `after`, not at the start of the step: `scan_after`
        return jnp.broadcast_to(zero_after(after, x.dtype), x.shape)

    def zeros(self, batch_like, shape, dtype, after):
        import jax.numpy as jnp

        return jnp.broadcast_to(zero_after(after, dtype), (batch_like.shape[0],) + tuple(shape))

    def length(self, x, axis):
        return x.shape[axis]  # (static under JAX)

    def where(self, condition, x, y):
        import jax.numpy as jnp

        dtype = x.dtype if hasattr(x, "dtype") else y.dtype
        return jnp.where(condition, jnp.asarray(x, dtype), jnp.asarray(y, dtype))


def jax_rows(x, start, size, axis):
    import jax

    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


ENGINE = _Engine()


def ones(batch_like, shape, dtype):
    """Ones of `[batch of batch_like] + shape` (what the dropout's decision is drawn on)."""
    import jax.numpy as jnp

    return jnp.ones((batch_like.shape[0],) + tuple(shape), dtype)


def dropout_bits(dropout, batch_like, shape, dtype, rows):
    """The decision of Keras 3's JAX `Dropout` as bits, drawn `rows` query rows at a time
    (`keep_bits`; `dtype` is not used: the draw does not depend on it), or None where
    that cannot be done exactly: the caller draws it whole.

    Outside a recomputed call (`"attention"`: the core alone recomputes), a `Redraw`:
    the seed the bits are drawn from and the draw, which `attention` runs in its forward
    pass and again in its backward pass, keeping the seed, not the bits -- as Keras's
    checkpointed core keeps its dropout's seed (XLA:GPU's plan, seq 256, small widths:
    the bits were the only residual Keras's core does not keep). Inside one (`"full"`),
    the bits: the call's recomputation draws them already, next to the backward pass."""
    found = _bit_draw(dropout, batch_like, shape, rows)
    if found is None:
        return None
    seed, draw = found
    from ..engine._running import inside_recomputed_call

    if inside_recomputed_call():
        return draw(seed, batch_like)
    return Redraw(seed, draw)


class Redraw:
    """The dropout's decision as `seed` and `draw(seed, after) -> bits` (the bits made
    after `after`): what `attention` keeps is the seed."""

    def __init__(self, seed, draw):
        self.seed, self.draw = seed, draw


def keep_bits(dropout, batch_like, shape, rows):
    """The decision of Keras 3's JAX `Dropout` layer `dropout` on ones of
    `[batch of batch_like] + shape` ([heads, queries, keys]), packed as `pack` packs it,
    drawn `rows` query rows at a time (`scan_after`): the same numbers as the layer's
    own draw -- `jax.random.bernoulli(seed_generator.next(), 1 - rate, shape)` -- whose
    threefry counter for an entry is its index in the whole array (JAX's partitionable
    threefry, its default), so that a block of rows is the draw at its own counters.
    None where that does not hold (another dropout, a noise shape, another PRNG, 64-bit
    floats, more than 2^32 entries): the caller draws it whole.
    `test_blocked_attention_jax.py` checks the bits against the layer's own masks."""
    found = _bit_draw(dropout, batch_like, shape, rows)
    return None if found is None else found[1](found[0], batch_like)


def _drawable(dropout):
    """Whether `dropout` is a Keras 3 `Dropout` on JAX whose draw `_bit_draw` reproduces:
    no noise shape, a rate strictly between 0 and 1, JAX's partitionable threefry2x32 in
    32 bits."""
    import sys

    import jax

    keras = sys.modules.get("keras")
    return not (keras is None
                or type(dropout) is not getattr(getattr(keras, "layers", None), "Dropout", None)
                or dropout.noise_shape is not None or keras.backend.backend() != "jax"
                or not 0.0 < dropout.rate < 1.0
                or not jax.config.jax_threefry_partitionable
                or jax.config.jax_enable_x64
                or str(jax.config.jax_default_prng_impl) != "threefry2x32")


def _bit_draw(dropout, batch_like, shape, rows):
    """`keep_bits` in two parts: `(seed, draw)` -- the seed drawn from the layer's seed
    generator now, and `draw(seed, after)`, the bits from that seed made after `after` --
    or None."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ..engine._running import batch_window

    batch = batch_like.shape[0]
    heads, queries, keys = (int(n) for n in shape)
    if batch is None or not _drawable(dropout):
        return None
    rows = max(1, min(int(rows), queries))
    n = -(-queries // rows)
    window = batch_window()  # a cut of the batch: the whole batch's counters, from its start
    whole = batch if window is None else window.batch
    if whole * heads * n * rows * keys >= 2**32:
        return None
    first = jnp.uint32(0) if window is None else jnp.asarray(window.start).astype(jnp.uint32)
    from jax.extend.random import threefry2x32_p
    from ..adapters._keras_private import draw_seed

    seed = jnp.asarray(draw_seed(dropout.seed_generator))  # what Keras's dropout draws with
    if seed.dtype != jnp.uint32 or seed.shape != (2,):
        return None
    keep_prob = 1.0 - dropout.rate  # as Keras's dropout computes it
    p = jnp.asarray(keep_prob)  # (jax.random.bernoulli's dtype for it: float32)
    one = np.array(1.0, np.float32).view(np.uint32)

    def body(carry, i):
        seed, start = carry
        # the entry (b, h, r, c) of the whole draw has the counter ((b * heads + h) *
        # queries + r) * keys + c (high word 0: fewer than 2^32 entries)
        # built from small vectors, the block's row offset entering before any full-size
        # value: full-size iotas do not depend on the loop, and XLA:GPU hoisted them out of
        # it, and scheduled those of every layer's recomputation at the start of the step
        bh = ((jnp.arange(batch, dtype=jnp.uint32) + first)[:, None] * heads
              + jnp.arange(heads, dtype=jnp.uint32)[None, :])  # [batch, heads]
        # (`start`: a zero, which the backward pass's draw (`Redraw`) passes through its
        # optimization barrier: the counters are made again there, not kept from the
        # forward pass's draw -- XLA:GPU kept them, one block alone being constants)
        r = jnp.arange(rows, dtype=jnp.uint32) + (i * rows).astype(jnp.uint32) + start  # [rows]
        c = jnp.arange(keys, dtype=jnp.uint32)
        count = (bh[:, :, None, None] * queries + r[:, None]) * keys + c
        bits1, bits2 = threefry2x32_p.bind(seed[0], seed[1], jnp.zeros_like(count), count)
        bits = bits1 ^ bits2  # jax.random.bits, 32 bits
        # jax.random.uniform's float32 in [0, 1), then bernoulli's `uniform < p`
        floats = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(one),
                                              jnp.float32) - jnp.float32(1.0)
        keep = jnp.maximum(jnp.float32(0.0), floats) < p
        return carry, pack(keep)

    def draw(seed, after, start=None):
        _, ys = scan_after(body, (seed, jnp.uint32(0) if start is None else start), n, after)  # [blocks, batch, heads, rows, keys / 8]
        moved = jnp.moveaxis(ys, 0, 2)
        joined = moved.reshape((batch, heads, n * rows) + moved.shape[4:])
        return joined if n * rows == queries else joined[:, :, :queries]

    return seed, draw


def attention(logits, query, key, value, mask, bits, rate, block, key_block=None):
    """FlashAttention-2 (`_flash.forward`) as one `jax.custom_vjp` of `query`, `key` and
    `value`, whose gradient is `_flash.backward` (residuals: the inputs, `mask`, `bits`
    -- or, where `bits` is a `Redraw`, its seed, the bits drawn again in the backward
    pass -- and, where there are key blocks, the output and the per-row log-sum-exp:
    `_flash.uses_output`)."""
    import jax
    import jax.numpy as jnp

    redraw = bits if isinstance(bits, Redraw) else None

    def drawn(bits, after, start=None):  # the bits, from the seed where drawn again (`Redraw`)
        return bits if redraw is None else redraw.draw(bits, after, start)

    @jax.custom_vjp
    def core(query, key, value, mask, bits):
        return _flash.forward(ENGINE, logits, query, key, value, mask, drawn(bits, query), rate,
                              block, key_block)[0]

    def core_fwd(query, key, value, mask, bits):
        out, lse = _flash.forward(ENGINE, logits, query, key, value, mask, drawn(bits, query),
                                  rate, block, key_block)
        # the output and the log-sum-exp only where the backward pass reads them (key
        # blocks: `_flash.uses_output`). With one key block each backward tile holds the
        # whole row and takes its softmax again, as the forward pass did; kept, the output
        # would be kept twice under "attention" -- as this residual and, in another layout,
        # as the output projection's input (XLA:GPU's plan, small widths: one [seq, hidden]
        # per layer) -- and the log-sum-exp is a per-row statistic that Keras's core does
        # not keep (the plan: 15 KB per layer above Keras's core at seq 256, batch 4)
        if _flash.uses_output(key.shape[1], key_block):
            return out, (query, key, value, mask, bits, out, lse)
        return out, (query, key, value, mask, bits, None, None)

    def core_bwd(residuals, d_out):
        # after the gradient: no common subexpression with the forward pass (XLA would keep
        # the forward's scores for the backward's)
        (q, k, v, m, b, o, s), after = jax.lax.optimization_barrier((residuals, d_out))
        # the bits drawn again after the gradient: `keep_bits`'s `start`, a zero computed from
        # the barrier's gradient (never both NaN and infinite; XLA cannot fold it), which
        # keeps the barrier's order (an unused output is dropped, and the order with it) and
        # costs no barrier of its own (XLA:GPU: a small tuple buffer each)
        corner = after[(0,) * after.ndim]
        start = (None if redraw is None else
                 (jnp.isnan(corner) & jnp.isinf(corner)).astype(jnp.uint32))
        d_q, d_k, d_v = _flash.backward(ENGINE, logits, q, k, v, m, drawn(b, d_out, start), rate,
                                        block, d_out, o, s, key_block)
        return d_q, d_k, d_v, _no_gradient(m), _no_gradient(b)

    core.defvjp(core_fwd, core_bwd)
    return core(query, key, value, mask, bits if redraw is None else redraw.seed)


def _no_gradient(x):
    """The cotangent of a non-differentiable input of a `custom_vjp` (a mask, bits)."""
    if isinstance(x, tuple):
        return tuple(_no_gradient(m) for m in x)
    if x is None:
        return None
    import jax
    import jax.numpy as jnp
    import numpy as np

    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
