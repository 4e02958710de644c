"""The feed-forward layer under the "attention" policy: its GELU's intermediates are
recomputed, not kept.

bert4keras's `FeedForward` is `o_dense(gelu(i0_dense(x)))`. Without
recomputation the backward pass keeps, per layer, the GELU's input, its
`x / sqrt(2)`, erf, `1 + erf`, `0.5 x` and its output (six [seq, ffn]
tensors; ffn = 4 x hidden in BERT). Under `patch(policy="attention")` with
recomputation on it keeps only the GELU's input:

- `gelu_grad` is the gradient of bert4keras's `gelu_erf` from its input alone,
  with the ops TensorFlow's autodiff runs, in its order;
- `lean_call` (the standard layer: one GELU, float32, a rank-3 input) computes
  the two dense layers as tf_keras's `Dense` does, with `gelu(h) @ kernel`
  under one gradient (`_gelu_matmul`: `recompute.ops._gelu.gelu_matmul`, which
  the Keras families' "attention" uses too) that recomputes `gelu(h)` for the
  kernel's gradient instead of keeping it;
- every recomputation waits for the incoming gradient (`recompute.engine.after`): a
  graph executor runs an op as soon as its inputs exist, so ops that read
  only forward tensors would run in the forward pass and keep their outputs;
- fed by a LayerNormalization unit (which keeps only its input), the first dense
  layer makes the LayerNorm's output again for its kernel's gradient
  (`remade_from_input`, `recompute.ops._lean.matmul_recomputing_input`) instead of
  keeping it; so do an attention layer's query, key and value dense layers
  (`dense_inputs_remade`);
- elsewhere (a gated or other activation, mixed precision), the GELU alone
  keeps only its input (`_patch._gelu`) and `o_dense` keeps its output.

Recomputed (with its block under "block" and "block_keep_ffn", alone under
"layer"), the standard layer runs as `lean_call` too, in the forward pass and in the
recomputation, so that the recomputation's backward pass keeps the GELU's input
alone and runs its gradient in chunks of rows (since 2026-11-29; before, bert4keras's
own code, whose autodiff kept four [seq, ffn] tensors there). Under
`patch(policy="block_keep_ffn")` `lean_call(..., keep_product=True)` also keeps the
second dense layer's product from the forward pass for the recomputation (see there);
under "block", where the block's last LayerNorm takes its gradient from the block's
output (`_norm_from_output`), `lean_call(..., skip_product=True)` does not compute it in
the recomputation.
"""

import contextlib
import math

import tensorflow as tf

from .. import engine
from ..ops import _gelu, _lean

REMADE_ATTR = "_recompute_remade_from"  # set on a LayerNorm's output: (its input, the norm)


def remade_from_input(output, x, norm):
    """`output` (a LayerNormalization unit's output under "attention"), marked as made again
    by `norm(x)` from the unit's kept input `x`: a `FeedForward` fed by it does not keep it
    for its first kernel's gradient (`lean_call`). Returns `output`."""
    if isinstance(output, tf.Tensor) and isinstance(x, tf.Tensor):
        setattr(output, REMADE_ATTR, (x, norm))
    return output


def remaking(output):
    """`remake(gate)` for an output marked by `remade_from_input`: the norm's call on its
    kept input, once `gate` (the incoming gradient) exists; None for any other value."""
    remade = getattr(output, REMADE_ATTR, None)
    if remade is None:
        return None
    x, norm = remade
    return _lean.remade_after(norm, x)


@contextlib.contextmanager
def dense_inputs_remade(layer, inputs):
    """While active, the plain `Dense` sublayers of `layer` (bert4keras's attention: its
    query, key and value `Dense` layers) fed a LayerNormalization unit's output marked by
    `remade_from_input` among `inputs` make it again for their kernels' gradients
    (`_lean.remaking_input`) instead of keeping it; otherwise nothing changes."""
    values = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    remakes = {id(v): (v, remaking(v)) for v in values}  # (q, k, v: one tensor, once)
    denses = [v for v in vars(layer).values() if _lean.plain_dense(v) is not None]
    with contextlib.ExitStack() as stack:
        for x, remake in remakes.values():
            if remake is not None and denses:
                stack.enter_context(_lean.remaking_input(denses, x, remake))
        yield


def gelu_grad(x, dy):
    """The gradient of `0.5 * x * (1 + erf(x / sqrt(2)))` at `x` times `dy`:
    TensorFlow's autodiff of it, op for op, with the forward values recomputed.

    Pass `x` gated on the gradient (`after([x], dy)`): ops that read only
    forward tensors would otherwise run in the forward pass and their outputs
    wait in memory for the backward pass, which is what recomputing saves."""
    root2 = tf.constant(math.sqrt(2.0), x.dtype)
    t = x / root2
    d_half_x = dy * (1.0 + tf.math.erf(t))
    d_erf = (0.5 * x) * dy
    d_t = d_erf * tf.constant(2.0 / math.sqrt(math.pi), x.dtype) * tf.exp(-tf.square(t))
    return 0.5 * d_half_x + d_t / root2


def is_gelu_erf(fn):
    """True for bert4keras's `gelu_erf`, wrapped by `_patch._gelu` or not."""
    return getattr(getattr(fn, "__wrapped__", fn), "__name__", None) == "gelu_erf"


def lean_applies(layer, inputs):
    """True if `lean_call(layer, inputs)` computes `layer(inputs)` (the standard case)."""
    if len(getattr(layer, "activation", ())) != 1 or not is_gelu_erf(layer.activation[0]):
        return False
    i0, o = getattr(layer, "i0_dense", None), getattr(layer, "o_dense", None)
    if i0 is None or o is None or not (i0.built and o.built) or not is_gelu_erf(i0.activation):
        return False  # (unbuilt: the layer's own call builds them)
    if getattr(o.activation, "__name__", None) != "linear":
        return False
    float32 = all(d.compute_dtype == "float32" and d.dtype == "float32" for d in (i0, o))
    return float32 and isinstance(inputs, tf.Tensor) and inputs.dtype == tf.float32 and inputs.shape.rank == 3


_matmul_last = _gelu.matmul_last  # `x @ w` over the last axis, as `tf.tensordot` runs it


def _gelu_matmul(h, kernel, gelu, product=None):
    """`gelu(h) @ kernel` whose gradient keeps only `h` (and the kernel): `_gelu.gelu_matmul`
    with bert4keras's GELU gradient.

    With `product` (that value, computed earlier) it is returned as the
    result instead of being computed again; the gradient is the same."""
    if product is None:
        forward = lambda k: _matmul_last(gelu(h), k)  # noqa: E731
    else:
        forward = lambda k: tf.identity(product)  # noqa: E731
    return _gelu.gelu_matmul(h, kernel, lambda x: (gelu(x), lambda d: gelu_grad(x, d)), forward,
                             matmul=_matmul_last)


def lean_call(layer, inputs, keep_product=False, skip_product=False):
    """`layer(inputs)` for a bert4keras `FeedForward` in the standard case
    (`lean_applies`): the same values, the GELU's output not kept.

    With `keep_product` (the "block_keep_ffn" policy, inside a recomputed
    block) the product `gelu(h) @ kernel` of the forward pass is kept
    (`recompute.engine.kept`) and the recomputation takes it instead of computing it
    again: that product is 30% of a BERT block's forward FLOPs (hidden x ffn
    of the block's 4 x hidden^2 + 2 x hidden x ffn + 2 x seq x hidden
    multiply-adds per token: 30% at BERT-base, seq 512) and one [seq, hidden]
    tensor per sample to keep. The recomputation still computes `h`, the
    first dense layer's output, which the gradient reads (and the gradient
    recomputes `gelu(h)` from it, as under "attention").

    With `skip_product` (under "block", in the recomputation of a block whose last
    LayerNorm takes its gradient from the block's output: `_norm_from_output`) the
    product's value is not needed: zeros stand for it, its gradient is the same.
    """
    i0, o = layer.i0_dense, layer.o_dense
    remake = remaking(inputs)
    if remake is None or keep_product:
        h = tf.tensordot(inputs, i0.kernel, [[2], [0]])
    else:  # the LayerNorm's output made again for the kernel's gradient, not kept
        h = _lean.matmul_recomputing_input(
            inputs, tf.convert_to_tensor(i0.kernel), remake,
            lambda kernel: tf.tensordot(inputs, kernel, [[2], [0]]))
    if i0.use_bias:
        h = tf.nn.bias_add(h, i0.bias)
    gelu = getattr(i0.activation, "__wrapped__", i0.activation)
    kernel = tf.convert_to_tensor(o.kernel)
    if skip_product:
        shape = h.shape[:-1].concatenate(kernel.shape[-1:])
        product = tf.zeros(shape if shape.is_fully_defined() else
                           tf.concat([tf.shape(h)[:-1], tf.shape(kernel)[-1:]], 0), h.dtype)
    elif keep_product:
        product = engine.kept(lambda: _matmul_last(gelu(h), kernel))
    else:
        product = None
    y = _gelu_matmul(h, kernel, gelu, product)
    if o.use_bias:
        y = tf.nn.bias_add(y, o.bias)
    return y
