"""A feed-forward pair under `"full"` on JAX: a `Dense` with an activation feeding a `Dense`
without one, run as one operation whose gradient keeps the first product and runs in chunks
of rows.

Inside a recomputed block the backward pass of `act(x @ W1 + b1) @ W2 + b2` under autodiff
holds the whole [rows, ffn] product, the activation's output and the two gradients at once
(XLA:GPU's plan of keras-hub BERT-base under `"full"`: three [seq, 3072] floats of the last
block, 18 of its 56.9 MiB per sample). `feed_forward` keeps the product `x @ W1 + b1` and
takes the gradient `CHUNKS` row blocks at a time, chained so that one block's activation,
its gradient and the product's gradient are alive at a time; the weights' gradients add up
over the blocks. Its value is the two layers' own (`keras.ops`, as `Dense.call` runs them);
its gradients equal autodiff's to float rounding (the activation's gradient is autodiff's,
`jax.vjp`; only the weights' sums run in another order). docs/attention.md, "The plan at
a GPU's batches".

`fused(sublayers)`, while active, makes each plain `Dense` among `sublayers` (float32
weights, computing in float32 or bfloat16) with an activation note its output, and each
plain `Dense` without one that is called on such an output compute the pair as
`feed_forward` from the first layer's input. The first layer's own product and activation,
then unused, are dropped by XLA under `jax.jit` (Keras's `fit` on JAX jits); run without
jit (`run_eagerly=True`, an unjitted `jax.grad`), JAX evaluates them and discards them: one
[rows, ffn] product and activation more in the forward pass. A `Dense` called on anything
else runs as written.
`recompute.policies._jax.full` runs the call inside it.
"""

import contextlib
import functools

from .._scoped import shadowed

CHUNKS = 4  # row blocks of the gradient (BERT-base, whole batches: 46.4 MiB per sample; 8: 45.4)
HALF_OR_FULL = ("float32", "bfloat16")  # the compute dtypes the pair runs in


def plain_dense(layer):
    """True for Keras 3's own `Dense` with float32 weights computing in float32 or bfloat16
    (not quantized, no LoRA, no `call` of the instance's own)."""
    import keras

    return (type(layer) is keras.layers.Dense and "call" not in vars(layer)
            and not getattr(layer, "quantization_mode", None)
            and not getattr(layer, "lora_enabled", False)
            and layer.dtype == "float32" and layer.compute_dtype in HALF_OR_FULL)


@contextlib.contextmanager
def fused(sublayers):
    """While active, the feed-forward pairs among `sublayers` run as `feed_forward` (the
    module docstring)."""
    import keras

    made = {}  # id(output) -> (output, input, layer) of a first `Dense` called in the block
    denses = [sub for sub in sublayers if plain_dense(sub)]
    linear = keras.activations.linear

    def first_call(layer, call):
        def run(inputs, *args, **kwargs):
            output = call(inputs, *args, **kwargs)
            made[id(output)] = (output, inputs, layer)
            return output

        return run

    def second_call(layer, call):
        def run(inputs, *args, **kwargs):
            found = made.get(id(inputs))
            if found is None or found[0] is not inputs or \
                    str(getattr(inputs, "dtype", "")) not in HALF_OR_FULL:
                return call(inputs, *args, **kwargs)
            _, x, first = found
            return feed_forward(first.activation, x, *_weights(first), *_weights(layer))

        return run

    replaced = [(d, "call", first_call(d, d.call) if d.activation not in (None, linear)
                 else second_call(d, d.call)) for d in denses]
    try:
        with shadowed(replaced):
            yield
    finally:
        made.clear()


def _weights(layer):
    import keras

    bias = None if layer.bias is None else keras.ops.convert_to_tensor(layer.bias)
    return keras.ops.convert_to_tensor(layer.kernel), bias


def feed_forward(activation, x, w1, b1, w2, b2):
    """`activation(x @ w1 + b1) @ w2 + b2` (either bias may be None) with the chunked gradient
    of the module docstring. Example, on Keras's JAX backend:

        y = feed_forward(keras.activations.gelu, x, w1, b1, w2, b2)  # x: [..., hidden]

    Limits: float32 or bfloat16 (the weights' gradients summed over the blocks in float32,
    rounded once to the weights' dtype); the rows are `x`'s leading axes flattened, split
    into `CHUNKS` blocks (fewer where there are fewer rows)."""
    return _op()(activation, x, w1, b1, w2, b2)


def _product(x, w, b):
    import keras

    y = keras.ops.matmul(x, w)
    return y if b is None else keras.ops.add(y, b)


@functools.lru_cache(maxsize=None)
def _op():
    """The `jax.custom_vjp` (built on first use: JAX is imported only on its backend)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(activation, x, w1, b1, w2, b2):
        return _product(activation(_product(x, w1, b1)), w2, b2)

    def forward(activation, x, w1, b1, w2, b2):
        pre = _product(x, w1, b1)
        return _product(activation(pre), w2, b2), (x, pre, w1, b1, w2, b2)

    def backward(activation, residuals, dy):
        x, pre, w1, b1, w2, b2 = residuals
        rows = x.reshape(-1, x.shape[-1])
        pres, grads = pre.reshape(-1, pre.shape[-1]), dy.reshape(-1, dy.shape[-1])
        f32 = jnp.float32  # the blocks' sums in float32, rounded once to the weights' dtype
        sums = tuple(jnp.zeros(s, f32) for s in (w1.shape, w1.shape[-1:], w2.shape,
                                                   w2.shape[-1:]))
        dxs = []
        for start, stop in _blocks(rows.shape[0]):
            xc, gc = rows[start:stop], grads[start:stop]
            if dxs:  # after the previous block: one block's temporaries alive at a time
                xc, gc, sums = jax.lax.optimization_barrier((xc, gc, sums))
            pc = pres[start:stop]
            h, activation_vjp = jax.vjp(activation, pc)
            dpre = activation_vjp(gc @ w2.T)[0]
            sums = (sums[0] + jnp.matmul(xc.T, dpre, preferred_element_type=f32),
                    sums[1] + dpre.sum(0, dtype=f32),
                    sums[2] + jnp.matmul(h.T, gc, preferred_element_type=f32),
                    sums[3] + gc.sum(0, dtype=f32))
            dxs.append(dpre @ w1.T)
        dx = jnp.concatenate(dxs, 0).reshape(x.shape)
        # the weights' gradients complete before the input's is used: else XLA:GPU deferred
        # them past the attention's backward pass, the product and blocks kept (offload:
        # 38.0 against 34.3 MiB per sample, docs/attention.md)
        dx, sums = jax.lax.optimization_barrier((dx, sums))
        dw1, db1, dw2, db2 = (s.astype(w.dtype) for s, w in zip(sums, (w1, w1, w2, w2)))
        return (dx, dw1, None if b1 is None else db1, dw2, None if b2 is None else db2)

    op.defvjp(forward, backward)
    return op


def _blocks(n):
    """`CHUNKS` (start, stop) row ranges covering `n` rows, as even as can be."""
    count = max(1, min(CHUNKS, n))
    edges = [n * i // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))
