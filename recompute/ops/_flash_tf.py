"""The blocked attention core (`_flash`) on TensorFlow: Keras 3's TensorFlow backend and tf_keras.

`attention(...)` is one `tf.custom_gradient` whose forward and backward passes
are `_flash.forward` and `_flash.backward`, their blocks a `tf.while_loop` of
one iteration at a time (a Python loop in eager mode). The gradient keeps the
inputs, the mask and the dropout's bits; its loop waits for the incoming
gradient (`_core.after`), so that a graph executor does not run it early. Where
one sample's [heads, queries, keys] tile holds `SAMPLE_ELEMENTS` or more and the
keys are one block, both passes run one sample at a time (`_by_sample`: a loop of
one iteration at a time), so that the [.., seq, seq] temporaries are one sample's,
whatever the batch.
"""

import numpy as np
import tensorflow as tf

from . import _flash
from ..adapters import _tf
from ..engine import _running
from ..engine._core import after

# Eight 0/1 bytes read as one 64-bit word: a product with _GATHER moves byte i's
# bit to bit i of the top byte (the partial products are distinct powers of 2,
# so nothing carries). Each row of keys is packed on its own, for blocks of rows.
_GATHER = 0x0102040810204080
# Unpacking: a byte times _SPREAD is 8 copies of it, one per byte of the word; _SELECT
# keeps bit i of byte i (little-endian: byte i is entry i).
_SPREAD = 0x0101010101010101
_SELECT = 0x8040201008040201


def pack(mask):
    """A bool [..., keys] mask as [..., ceil(keys / 8)] uint8, 1 bit per entry."""
    mask = tf.convert_to_tensor(mask)
    keys = mask.shape[-1]
    flat = tf.cast(mask, tf.uint8)
    pad = tf.math.floormod(-tf.shape(mask)[-1], 8) if keys is None else -keys % 8
    if keys is None or pad:
        flat = tf.pad(flat, [[0, 0]] * (mask.shape.rank - 1) + [[0, pad]])
    # (bitcast between rank-2 and rank-1 tensors only: XLA refuses some other shapes)
    words = tf.bitcast(tf.reshape(flat, [-1, 8]), tf.uint64) * tf.constant(_GATHER, tf.uint64)
    packed = tf.cast(tf.bitwise.right_shift(words, tf.constant(56, tf.uint64)), tf.uint8)
    packed = tf.reshape(packed, tf.concat([tf.shape(mask)[:-1], [-1]], 0))
    packed.set_shape(mask.shape[:-1].concatenate([None if keys is None else -(-keys // 8)]))
    return packed


class _Engine(_flash.Engine):
    name = "tensorflow"

    def rows(self, x, start, size, axis):
        index = [slice(None)] * x.shape.rank
        index[axis] = slice(start, start + size)
        y = x[tuple(index)]
        shape = y.shape.as_list()
        if shape[axis] is None:  # (a traced start: the size is still `size`)
            shape[axis] = size
            y.set_shape(shape)
        return y

    def pad(self, x, axis, amount, value):
        paddings = [[0, 0]] * x.shape.rank
        paddings[axis] = [0, amount]
        return tf.pad(x, paddings, constant_values=tf.cast(value, x.dtype))

    def scan(self, body, carry, n, y_dtypes, anchor):
        if tf.executing_eagerly():
            stacked = []
            for i in range(n):
                carry, ys = body(carry, tf.constant(i))
                stacked.append(ys)
            return carry, tuple(tf.stack([ys[j] for ys in stacked]) for j in range(len(y_dtypes)))
        arrays = tuple(tf.TensorArray(dtype, size=n, infer_shape=True) for dtype in y_dtypes)

        def step(i, carry, arrays):
            carry, ys = body(carry, i)
            return i + 1, carry, tuple(a.write(i, y) for a, y in zip(arrays, ys))

        _, carry, arrays = tf.while_loop(
            lambda i, *_: i < n, step, (tf.constant(0), carry, arrays),
            parallel_iterations=1, maximum_iterations=n)
        return carry, tuple(a.stack() for a in arrays)

    def chain(self, tensors, gate):
        return after(tensors, *gate), list(gate)

    def ordered(self, tensors, gate):
        return after(tensors, *gate)

    def vjp(self, fn, *primals):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(primals)
            out, aux = fn(*primals)

        def pullback(cotangent):
            return tape.gradient(out, list(primals), output_gradients=cotangent)

        return out, aux, pullback

    def cast_scalar(self, value, like):
        return tf.cast(value, like.dtype)

    def unpack(self, bits, keys):
        bits = tf.convert_to_tensor(bits)
        if bits.shape.is_fully_defined():
            # Each byte copied to the 8 bytes of a word, byte i keeping its bit i: four
            # passes over a byte per 8 entries, where shifting a broadcast byte by 0..7
            # passes over every entry three times (x4-5 the CPU time of the unpacking).
            # (XLA refuses the bitcast where a dimension is only bounded.)
            words = tf.bitwise.bitwise_and(
                tf.cast(tf.reshape(bits, [-1]), tf.uint64) * tf.constant(_SPREAD, tf.uint64),
                tf.constant(_SELECT, tf.uint64))
            flags = tf.reshape(tf.not_equal(tf.bitcast(words, tf.uint8), tf.zeros([], tf.uint8)),
                               bits.shape[:-1].concatenate([8 * bits.shape[-1]]))
        else:
            # (shifts, not a bitcast: XLA refuses to bitcast uint64 to uint8 inside the loop)
            shifts = tf.constant(list(range(8)), tf.uint8)
            flags = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits[..., None], shifts),
                                           tf.ones([], tf.uint8))
            flags = tf.not_equal(flags, tf.zeros([], tf.uint8))
            flags = tf.reshape(flags, tf.concat([tf.shape(bits)[:-1], [-1]], 0))
            width = bits.shape[-1]
            flags.set_shape(bits.shape[:-1].concatenate([None if width is None else 8 * width]))
        return flags if isinstance(keys, int) and keys % 8 == 0 else flags[..., :keys]

    def drop(self, x, keep, rate):
        # `tf.nn.experimental.stateless_dropout` and tf_keras's dropout: x * (1 / (1 - rate)),
        # zeroed where dropped.
        return tf.where(keep, x * tf.cast(1.0 / (1.0 - rate), x.dtype), tf.zeros([], x.dtype))

    def join(self, ys, rows, axis):
        # [blocks, d0.., block, ...] -> [d0.., blocks * block, ...] (block at `axis` + 1)
        rank = ys.shape.rank
        moved = tf.transpose(ys, list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank)))
        shape = tf.shape(moved)
        joined = tf.reshape(moved, tf.concat([shape[:axis], [-1], shape[axis + 2:]], 0))
        if joined.shape[axis] == rows:
            return joined
        index = [slice(None)] * (rank - 1)
        index[axis] = slice(0, rows)
        return joined[tuple(index)]

    def zeros_like(self, x, after):
        return tf.zeros_like(x)

    def zeros(self, batch_like, shape, dtype, after):
        return tf.zeros(tf.concat([tf.shape(batch_like)[:1], shape], 0), dtype)

    def length(self, x, axis):
        return tf.shape(x)[axis]

    def where(self, condition, x, y):
        dtype = x.dtype if tf.is_tensor(x) else y.dtype
        return tf.where(condition, tf.cast(x, dtype), tf.cast(y, dtype))


ENGINE = _Engine()

DRAW_ELEMENTS = 1 << 20  # random numbers per chunk of `stateless_keep_bits`: 4 MiB of float32


def keras_seed(dropout):
    """The seed Keras 3's TensorFlow dropout draws from `dropout` (a Keras `Dropout`): its
    generator's next seed, as int32 (Keras's `_cast_seed`)."""
    seed = dropout.seed_generator.next()
    if seed.dtype != tf.int32:
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return seed


def philox_at(seed, steps):
    """`(key, counter, alg)` of `seed`'s stateless Philox draw, its counter advanced by
    `steps` (a scalar tensor; `recompute.adapters._tf.philox_advanced`): the draw from there
    is the seed's draw without its first `4 * steps` numbers of float32
    (`stateless_keep_bits`)."""
    key, counter = _tf.philox_advanced(*tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed), steps)
    return key, counter, tf.raw_ops.StatelessRandomGetAlg()


def stateless_keep_bits(seed, rows_shape, keys, rate, first_row=0):
    """The bits of `tf.random.stateless_uniform(rows_shape + [keys], seed) >= rate`
    (float32), drawn in chunks of rows: `pack` of that mask, without the whole
    uniform tensor.

    TensorFlow's stateless Philox generator gives element `i` of a draw the
    `i % 4`-th number of the block at counter `c + i // 4`, where `(key, c)`
    come from the seed (`StatelessRandomGetKeyCounter`); so a chunk of
    consecutive elements starting at a multiple of 4 is the draw of its size at
    the counter advanced by its offset / 4 -- on TensorFlow's kernels and under
    XLA alike (each with its own numbers; tested). Chunks are whole rows of
    `keys`, a multiple of 4 rows, one at a time.

    Args:
        seed: the int32 [2] seed `tf.random.stateless_uniform` takes.
        rows_shape: a 1-D int32 tensor, the shape without the last axis.
        keys: the last axis's length (a Python int).
        rate: the dropout's rate (a Python float).
        first_row: where the rows start in the seed's draw (a scalar tensor or int; its
            `first_row * keys` a multiple of 4): the rows of a cut of the batch.

    Returns:
        uint8 bits of shape `rows_shape + [ceil(keys / 8)]`.
    """
    rows = tf.reduce_prod(rows_shape)
    chunk = max(4, (DRAW_ELEMENTS // keys) // 4 * 4)
    n = (rows + chunk - 1) // chunk
    first = tf.cast(first_row, tf.uint64) * tf.constant(keys, tf.uint64) // 4

    def step(i, array):
        offset = first + tf.cast(i, tf.uint64) * tf.constant(chunk * keys // 4, tf.uint64)
        key, counter, alg = philox_at(seed, offset)
        uniform = tf.raw_ops.StatelessRandomUniformV2(
            shape=[chunk, keys], key=key, counter=counter, alg=alg, dtype=tf.float32)
        return i + 1, array.write(i, pack(uniform >= tf.constant(rate, tf.float32)))

    array = tf.TensorArray(tf.uint8, size=n, element_shape=[chunk, -(-keys // 8)])
    _, array = tf.while_loop(lambda i, _: i < n, step, (tf.constant(0), array),
                             parallel_iterations=1)
    bits = array.concat()[:rows]
    return tf.reshape(bits, tf.concat([rows_shape, [-(-keys // 8)]], 0))


def dropout_bits(dropout, batch_like, shape, dtype, rows):
    """The decision of Keras 3's `Dropout` on the TensorFlow backend, as bits, drawn as it
    draws it -- `uniform >= rate` on a seed of its seed generator -- but in chunks
    (`stateless_keep_bits`): without the whole [batch, heads, seq, seq] uniform draw (nor
    the ones, scaled copy, cast mask and product of `dropout(ones)`). `rows` is not used
    (the chunks are sized by `DRAW_ELEMENTS`). None for any other dropout (tf_keras's) and
    other dtypes than float32: the caller draws it whole. Inside a cut of the batch
    (`recompute.engine._running.batch_window()`), the cut's rows of the batch's draw.
    `test_blocked_attention_core.py` checks that the masks are the layer's own."""
    import sys

    keras = sys.modules.get("keras")
    if (keras is None or type(dropout) is not getattr(getattr(keras, "layers", None), "Dropout", None)
            or dropout.noise_shape is not None or keras.backend.backend() != "tensorflow"
            or keras.backend.standardize_dtype(dtype) != "float32"):
        return None
    window = _running.batch_window()  # inside a cut: the cut's rows of the batch's draw
    per_sample = int(np.prod(shape[:-1]))
    if window is not None and (per_sample * shape[-1]) % 4:
        return None  # a cut not on a step of the counter: the caller's `Dropout` draws it
    first_row = 0 if window is None else tf.cast(window.start, tf.int64) * per_sample
    rows_shape = tf.concat([tf.shape(batch_like)[:1], shape[:-1]], 0)
    return stateless_keep_bits(keras_seed(dropout), rows_shape, shape[-1], dropout.rate,
                               first_row)


def ones(batch_like, shape, dtype):
    """Ones of `[batch of batch_like] + shape` (what the dropout's decision is drawn on)."""
    return tf.ones(tf.concat([tf.shape(batch_like)[:1], shape], 0), dtype)


def attention(logits, query, key, value, mask, bits, rate, block, key_block=None):
    """FlashAttention-2 (`_flash.forward`) as one `tf.custom_gradient` of `query`, `key`
    and `value`, whose gradient is `_flash.backward`: it keeps the inputs, `mask`, `bits`,
    and, where there are key blocks (`_flash.uses_output`), the output and the per-row
    log-sum-exp (with one key block the backward pass takes each row's softmax again and
    reads neither; kept, the output would be kept twice, here and as the output
    projection's input). With one key block and a large tile (`_sample_by_sample`) the
    forward and the backward pass run one sample at a time."""
    keeps_output = _flash.uses_output(key.shape[1], key_block)
    by_sample = not keeps_output and _sample_by_sample(query, key)

    @tf.custom_gradient
    def core(query, key, value):
        if by_sample:
            (output,) = _by_sample(
                lambda q, k, v, m, b: _flash.forward(ENGINE, logits, q, k, v, m, b, rate, block)[:1],
                [query, key, value, mask, bits], [(value.dtype, _output_shape(query, value))])
        else:
            output, lse = _flash.forward(ENGINE, logits, query, key, value, mask, bits, rate,
                                         block, key_block)

        def grad(d_out):
            # The recomputation waits for the gradient (see `_core.after`).
            if keeps_output:
                q, k, v, o, s = after([query, key, value, output, lse], d_out)
            else:
                (q, k, v), o, s = after([query, key, value], d_out), None, None
            m = _flash._map_mask(mask, lambda x: after([x], d_out)[0])
            b = None if bits is None else after([bits], d_out)[0]
            if by_sample:
                return _by_sample(
                    lambda q, k, v, m, b, d: _flash.backward(ENGINE, logits, q, k, v, m, b, rate,
                                                             block, d, None, None),
                    [q, k, v, m, b, d_out], [(t.dtype, t.shape) for t in (q, k, v)])
            return _flash.backward(ENGINE, logits, q, k, v, m, b, rate, block, d_out, o, s,
                                   key_block)

        return output, grad

    return core(query, key, value)


SAMPLE_ELEMENTS = 1 << 20  # from this many [heads, queries, keys] per sample, one sample at a time


def _sample_by_sample(query, key):
    """Whether `attention` runs one sample at a time: where one sample's [heads, queries,
    keys] tile holds `SAMPLE_ELEMENTS` or more (static shapes) and the batch is not one."""
    heads, queries, keys = query.shape[2], query.shape[1], key.shape[1]
    if None in (heads, queries, keys) or query.shape[0] == 1:
        return False
    return heads * queries * keys >= SAMPLE_ELEMENTS


def _sample(x, i):
    """Sample `i` of `x` (axis 0, kept as an axis of 1), or `x` where it broadcasts over
    the batch (axis 0 of 1; None stays None)."""
    if x is None or x.shape.rank == 0 or x.shape[0] == 1:
        return x
    if x.shape[0] is None:  # (an axis of 1 known only when run broadcasts too)
        i = tf.minimum(i, tf.shape(x)[0] - 1)
    return rows_at(x, i, 1)


def rows_at(x, start, size):
    """`x[start:start + size]` (axis 0; `size` a Python int) as one `tf.slice` of static
    size: on TensorFlow's kernels a view of `x`'s memory where `tf.gather` copies it (a
    slice of axis 0 aliases its input); under XLA a dynamic slice."""
    rest = x.shape[1:]
    sizes = ([size] + rest.as_list() if rest.is_fully_defined()
             else tf.concat([[size], tf.shape(x)[1:]], 0))
    begin = tf.concat([tf.reshape(tf.cast(start, tf.int32), [1]),
                       tf.zeros([rest.rank], tf.int32)], 0)
    y = tf.slice(x, begin, sizes)
    y.set_shape(tf.TensorShape([size]).concatenate(rest))
    return y


def _output_shape(query, value):
    return query.shape[:-1].concatenate(value.shape[-1:])


def _by_sample(fn, tensors, outs):
    """`fn(*tensors of one sample)` (a list of tensors of one sample each) for the samples
    of the batch of `tensors[0]` one at a time (`ENGINE.scan`: a loop of one iteration at
    a time), the results joined along axis 0 (`outs`: their dtypes and static shapes,
    batch included); masks (tuples allowed) as `_sample` takes them."""

    def pick(t, i):
        return _flash._map_mask(t, lambda m: _sample(m, i)) if isinstance(t, tuple) \
            else _sample(t, i)

    def body(carry, i):
        return carry, tuple(fn(*[pick(t, i) for t in tensors]))

    _, stacked = ENGINE.scan(body, (), tf.shape(tensors[0])[0], [d for d, _ in outs], None)
    joined = []
    for y, (_, shape) in zip(stacked, outs):  # [samples, 1, ...] -> [samples, ...]
        y = tf.reshape(y, tf.concat([[-1], tf.shape(y)[2:]], 0))
        y.set_shape(shape)
        joined.append(y)
    return joined
