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
uses it on TensorFlow as `lean_feed_forward(layers)`, which also runs the
`Dense` layer fed by such a GELU as `gelu_matmul` (its product under a gradient
that computes the GELU again from its input for the kernel's gradient): every
feed-forward keeps one [seq, ffn] tensor, the GELU's input, instead of five (the
four, and the GELU's output that the next `Dense` kept). On Keras 3's
JAX backend the same policy installs `checkpointed(gelu)` instead
(`kept_input(layers, checkpointed)`): `jax.checkpoint` of the GELU, which keeps
its input and replays its own jaxpr for the gradient (autodiff keeps four
[seq, ffn] values there too: the input, the erfc, the exp and 0.5 x).

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

_GELUS = (_keras_private.GELU, _tf_keras.GELU)
_MARK = "__recompute_gelu__"
_FLOATS = (tf.float32, tf.float64)


def is_exact_gelu(fn):
    """True for Keras 3's or tf_keras's `activations.gelu` (exact, erf-based, as
    `Dense(activation="gelu")` calls it)."""
    return (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) in _GELUS


def gelu_grad(x, dy):
    """The gradient of `tf.nn.gelu(x)` times `dy`: autodiff's ops, in its order.

    Pass `x` gated on the gradient (`_core.after([x], dy)`), so that the
    recomputed ops wait for the backward pass instead of running (and being
    kept) in the forward pass."""
    c = tf.cast(0.7071067811865476, x.dtype)
    u = -x * c
    d_half_x = dy * tf.math.erfc(u)  # Mul's gradient: grad * the other factor
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
        return gelu_keeping_input(x) if x.dtype in _FLOATS else gelu(x)

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


def gelu_matmul(h, kernel, gelu, grad, forward, matmul=matmul_last):
    """`forward(kernel)` -- the product `gelu(h) @ kernel` as the caller computes it --
    under a gradient that keeps only `h` and the kernel: when the incoming gradient
    has arrived (`after`), `gelu(h)` is computed again for the kernel's gradient, and
    `grad(h, d_gelu)` (the GELU's gradient from its input) carries the gradient to `h`.
    `matmul(x, w, **kwargs)` is the product over the last axis the gradient uses
    (`matmul_last`)."""

    @tf.custom_gradient
    def product(h, kernel):
        def gradient(dy):
            h_ = after([h], dy)[0]  # recomputed when the gradient arrives, not in the forward pass
            g = gelu(h_)
            units = kernel.shape[-1]
            d_kernel = tf.matmul(tf.reshape(g, [-1, g.shape[-1]]), tf.reshape(dy, [-1, units]),
                                 transpose_a=True)
            return grad(h_, matmul(dy, kernel, transpose_b=True)), d_kernel

        return forward(kernel), gradient

    return product(h, kernel)


def _keras3_product(x):
    """`keras.layers.Dense`'s product of `x`, as a function of the kernel."""
    from keras import ops

    return lambda kernel: ops.matmul(x, kernel)


def _keras3_rest(layer, y):
    """The rest of `keras.layers.Dense.call` after its product `y`."""
    from keras import ops

    if layer.bias is not None:
        y = ops.add(y, layer.bias)
    return layer.activation(y) if layer.activation is not None else y


def _tf_keras_product(x):
    """`tf_keras.layers.Dense`'s product of `x` (`core_ops.dense`: `tf.matmul` at rank 2,
    else `tf.tensordot`), as a function of the kernel."""
    rank = x.shape.rank
    if rank == 2:
        return lambda kernel: tf.matmul(x, kernel)

    def product(kernel):
        y = tf.tensordot(x, kernel, [[rank - 1], [0]])
        if not tf.executing_eagerly():
            y.set_shape(x.shape[:-1].concatenate([kernel.shape[-1]]))
        return y

    return product


def _tf_keras_rest(layer, y):
    """The rest of `tf_keras.layers.Dense.call` after its product `y`."""
    if layer.use_bias:
        y = tf.nn.bias_add(y, layer.bias)
    return layer.activation(y) if layer.activation is not None else y


# The plain `Dense` of each family, (module, name): (its product, the rest of its call)
_DENSES = {
    _keras_private.DENSE: (_keras3_product, _keras3_rest),
    _tf_keras.DENSE: (_tf_keras_product, _tf_keras_rest),
}


def _plain_dense(layer):
    """`(product, rest)` of `_DENSES` for a plain float `Dense` (the family's own class, not
    quantized, no LoRA, no autocast, no `call` of the instance's own), else None."""
    cls = type(layer)
    found = _DENSES.get((cls.__module__, cls.__name__))
    if found is None or "call" in vars(layer) or getattr(layer, "quantization_mode", None) \
            or getattr(layer, "lora_enabled", False) or layer.compute_dtype != layer.dtype:
        return None
    return found


@contextlib.contextmanager
def lean_feed_forward(layers):
    """TensorFlow, `policy="attention"`: while active, the exact GELUs among `layers` keep
    only their input (`kept_input`), and each plain `Dense` among `layers` (`_plain_dense`)
    whose input is such a GELU's float output computes its product as `gelu_matmul`: the
    GELU's output is not kept for the kernel's gradient, the GELU runs again from its
    input instead. Other inputs go to the layer's own `call`."""
    outputs = {}  # id(the GELU's output) -> (the output, its input, the Keras GELU)

    def recording(own):
        kept = keeping_input(own)

        def activation(x):
            y = kept(x)
            if getattr(y, "dtype", None) in _FLOATS:
                outputs[id(y)] = (y, x, own)
            return y

        setattr(activation, _MARK, True)
        return activation

    def lean_call(layer, own_call, product, rest):
        def lean(inputs, *args, **kwargs):
            found = outputs.get(id(inputs))
            if found is None or found[0] is not inputs:
                return own_call(inputs, *args, **kwargs)
            _, h, gelu = found
            kernel = tf.convert_to_tensor(layer.kernel)
            return rest(layer, gelu_matmul(tf.convert_to_tensor(h), kernel, gelu, gelu_grad,
                                           product(inputs)))

        setattr(lean, _MARK, True)
        return lean

    denses = ((layer, _plain_dense(layer)) for layer in layers)
    with kept_input(layers, recording), shadowed(
            (layer, "call", lean_call(layer, layer.call, *found))
            for layer, found in denses if found is not None):
        try:
            yield
        finally:
            outputs.clear()
