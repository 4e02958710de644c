"""The exact GELU of the Keras families, with a gradient that keeps only its input.

`Dense(activation="gelu")` computes TensorFlow's `tf.nn.gelu(x)`, that is
`0.5 * x * erfc(-x * (1 / sqrt(2)))`, and autodiff keeps four of its
[batch, seq, units] intermediates for the gradient (`0.5 x`, `-x / sqrt(2)`,
the erfc and the input). `keeping_input(gelu)` computes the same values and
keeps the input alone; its gradient (`gelu_grad`) runs the ops TensorFlow's
autodiff runs, in its order, on the forward values computed again -- so the
gradients are bit for bit those of the plain GELU.

`kept_input(layers)` installs it on the layers among `layers` whose `activation`
is the exact GELU of Keras 3 or tf_keras (shadowed on the instances while a
decorated call runs, then restored). `recompute_grad(policy="attention")`
uses it on TensorFlow through `_lean.lean_layers`, whose `Dense` fed by such a
GELU does not keep the GELU's output either. On Keras 3's
JAX backend the same policy installs `checkpointed(gelu)` instead
(`kept_input(layers, checkpointed)`): `jax.checkpoint` of the GELU, which keeps
its input and replays its own jaxpr for the gradient (autodiff keeps four
[seq, ffn] values there too: the input, the erfc, the exp and 0.5 x).
`gelu_matmul` is bert4keras's `FeedForward` product (`recompute.bert4keras._feed_forward`)
and `_lean`'s `Dense` fed by a GELU; its gradient runs in chunks of rows
(`chunk_rows`, about `CHUNK_ELEMENTS` elements each, one chunk at a time), so that
the GELU's and the product's [rows, units] temporaries are one chunk's, not the
batch's (BERT-base, seq 512: four [seq, ffn] temporaries per sample at the backward
pass's peak before).

Bit for bit holds op for op (eager, and `tf.function` on its own), not under
every graph rewrite: in `fit` and with oneDNN's rewrites, TensorFlow's
optimizer rounds the plain GELU's gradient differently from the same ops
written out (measured: losses equal, gradients to float rounding). So
`policy="full"`, which promises bit-for-bit gradients, leaves GELUs as they
are.
"""

import contextlib

import numpy as np
import tensorflow as tf

from ..adapters import _keras_private, _tf_keras
from ..engine._core import after
from .._scoped import shadowed
from . import _flash_tf

_GELUS = (_keras_private.GELU, _tf_keras.GELU)
_MARK = "__recompute_gelu__"
FLOATS = (tf.float32, tf.float64)


def is_exact_gelu(fn):
    """True for Keras 3's or tf_keras's `activations.gelu` (exact, erf-based, as
    `Dense(activation="gelu")` calls it)."""
    return (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) in _GELUS


_C = 0.7071067811865476  # tf.nn.gelu's 1 / sqrt(2)


def gelu_grad(x, dy, erfc=None):
    """The gradient of `tf.nn.gelu(x)` times `dy`: autodiff's ops, in its order
    (`erfc`: `erfc(-x / sqrt(2))` where the caller has it, `with_erfc`).

    Pass `x` gated on the gradient (`_core.after([x], dy)`), so that the
    recomputed ops wait for the backward pass instead of running (and being
    kept) in the forward pass."""
    c = tf.cast(_C, x.dtype)
    u = -x * c
    # Mul's gradient: grad * the other factor
    d_half_x = dy * (tf.math.erfc(u) if erfc is None else erfc)
    d_erfc = dy * (0.5 * x)
    d_u = d_erfc * tf.constant(-2 / np.sqrt(np.pi), dtype=dy.dtype) * tf.exp(-tf.square(u))
    return (0.5 * d_half_x) + (-(d_u * c))


def keeping_input(gelu):
    """`gelu` (an exact Keras GELU) whose gradient keeps only its input."""

    @tf.custom_gradient
    def gelu_keeping_input(x):
        return gelu(x), lambda dy: gelu_grad(after([x], dy)[0], dy)

    def activation(x):
        x = tf.convert_to_tensor(x)
        # float32/64 only: in half precision, graph rewrites of the plain GELU's
        # gradient round differently (measured: not bit for bit in tf.function).
        return gelu_keeping_input(x) if x.dtype in FLOATS else gelu(x)

    setattr(activation, _MARK, True)
    return activation


def checkpointed(gelu):
    """`gelu` (an exact Keras GELU) under `jax.checkpoint`, for Keras 3's JAX backend:
    its gradient keeps only its input and recomputes the rest from the same jaxpr.
    Symbolic tensors (Keras's shape inference) and other than float32/float64 inputs
    (as `keeping_input`) run the GELU as it is."""
    import jax
    import jax.numpy as jnp

    kept = jax.checkpoint(gelu)

    def activation(x):
        floating = isinstance(x, jax.Array) and x.dtype in (jnp.float32, jnp.float64)
        return kept(x) if floating else gelu(x)

    setattr(activation, _MARK, True)
    return activation


@contextlib.contextmanager
def kept_input(layers, keep=None):
    """While active, each of `layers` whose `activation` is an exact Keras GELU uses
    `keep(activation)` (an instance attribute, restored on exit): by default
    `keeping_input` (TensorFlow), `checkpointed` on JAX."""
    keep = keep or keeping_input
    gelus = ((layer, getattr(layer, "activation", None)) for layer in layers)
    with shadowed((layer, "activation", keep(own)) for layer, own in gelus
                  if own is not None and not getattr(own, _MARK, False) and is_exact_gelu(own)):
        yield


def matmul_last(x, w, **kwargs):
    """`x @ w` over the last axis of `x`, as `tf.tensordot` runs it: one `tf.matmul` of `x`
    flattened to rank 2 (`kwargs`: `tf.matmul`'s, such as `transpose_b`)."""
    shape = tf.shape(x)
    flat = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), w, **kwargs)
    units = w.shape[0] if kwargs.get("transpose_b") else w.shape[-1]
    return tf.reshape(flat, tf.concat([shape[:-1], [units]], 0))


def kernel_gradient(x, dy, kernel):
    """The gradient of `kernel` in `x @ kernel` (over the last axis) for the product's
    gradient `dy`: `x` and `dy` flattened to rank 2, `xᵀ dy`."""
    return tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), tf.reshape(dy, [-1, kernel.shape[-1]]),
                     transpose_a=True)


def with_erfc(h):
    """`(tf.nn.gelu(h), its gradient)` (exact: `0.5 h erfc(-h / sqrt(2))`, the same ops),
    the two sharing one `erfc` pass: `gelu_matmul`'s `gelu_and_grad` for Keras's GELU."""
    erfc = tf.math.erfc(-h * tf.cast(_C, h.dtype))
    return 0.5 * h * erfc, lambda dy: gelu_grad(h, dy, erfc)


def gelu_matmul(h, kernel, gelu_and_grad, forward, matmul=matmul_last):
    """`forward(kernel)` -- the product `gelu(h) @ kernel` as the caller computes it --
    under a gradient that keeps only `h` and the kernel: when the incoming gradient
    has arrived (`after`), `gelu_and_grad(h)` gives `gelu(h)` again, for the kernel's
    gradient, and the GELU's gradient at `h` (a function of the incoming one), which
    carries the gradient to `h`. `matmul(x, w, **kwargs)` is the product over the last
    axis the gradient uses (`matmul_last`). The gradient runs chunk of rows by chunk of
    rows (`chunk_rows`); the kernel's gradient is the sum of the chunks' products."""

    @tf.custom_gradient
    def product(h, kernel):
        def gradient(dy):
            h_ = after([h], dy)[0]  # recomputed when the gradient arrives, not in the forward pass
            return _in_row_chunks(h_, dy, kernel, gelu_and_grad, matmul)

        return forward(kernel), gradient

    return product(h, kernel)


# About this many elements of `h` per chunk of `gelu_matmul`'s gradient: 1024 rows at FFN
# 3072 (12 MiB of float32 per [rows, ffn] temporary). Chunks of 2^20 cost about 2.5% of a
# BERT-base step's CPU time in the loop (docs/attention.md, "CPU time on TensorFlow: the
# step's work on one thread, ..."); one chunk's temporaries do not grow with the batch.
CHUNK_ELEMENTS = 1 << 22


def _divisor(n, at_most):
    """The largest divisor of `n` that is at most `at_most` (>= 1)."""
    return next(d for d in range(max(1, min(n, at_most)), 0, -1) if n % d == 0)


def chunk_rows(shape):
    """The rows (of `h` flattened to rank 2) of one chunk of `gelu_matmul`'s gradient for an
    `h` of static shape `shape` ([batch, seq, units] or any rank >= 2): about
    `CHUNK_ELEMENTS` elements, whole sequences or a divisor of one, so that every chunk is
    whole (the same shape: XLA compiles it); None (one chunk, the whole: no loop) where the
    lengths are not known, no divisor near that size exists, or one chunk would hold every
    row."""
    units, seq = shape[-1], (shape[-2] if len(shape) > 2 else None)
    if units is None or seq is None:
        return None
    target = max(1, CHUNK_ELEMENTS // units)
    if target >= seq:
        batch = 1
        for d in shape[:-2]:
            batch = None if d is None or batch is None else batch * d
        if batch is None:
            return seq
        samples = _divisor(batch, target // seq)
        return None if samples == batch else seq * samples
    rows = _divisor(seq, target)
    return rows if rows * 8 >= target else None


def _in_row_chunks(h, dy, kernel, gelu_and_grad, matmul):
    """`(d_h, d_kernel)` of `gelu(h) @ kernel` for `dy`, in chunks of `chunk_rows` rows, one
    chunk at a time (`_flash_tf.ENGINE.scan`: a loop of one iteration at a time): the
    GELU's and the product's [rows, units] temporaries of one chunk alive, not of the
    whole batch."""
    rows = chunk_rows(h.shape.as_list())
    units, out = h.shape[-1], kernel.shape[-1]
    if rows is None:
        g, grad = gelu_and_grad(h)
        return grad(matmul(dy, kernel, transpose_b=True)), kernel_gradient(g, dy, kernel)
    h3, dy3 = tf.reshape(h, [-1, rows, units]), tf.reshape(dy, [-1, rows, out])  # (no copies)

    def body(d_kernel, i):
        # (views of h and dy on TensorFlow's kernels, not copies)
        h_c, dy_c = (tf.reshape(_flash_tf.rows_at(t, i, 1), t.shape[1:]) for t in (h3, dy3))
        g, grad = gelu_and_grad(h_c)
        d_kernel = d_kernel + tf.matmul(g, dy_c, transpose_a=True)
        return d_kernel, (grad(matmul(dy_c, kernel, transpose_b=True)),)

    d_kernel, (d_h,) = _flash_tf.ENGINE.scan(body, tf.zeros(kernel.shape, kernel.dtype),
                                             tf.shape(h3)[0], (h.dtype,), None)
    d_h = tf.reshape(d_h, tf.shape(h))
    d_h.set_shape(h.shape)
    return d_h, d_kernel
