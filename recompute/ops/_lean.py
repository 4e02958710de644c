"""The layers of a block under `policy="attention"` on TensorFlow, each keeping less.

`lean_layers(layers, tf_variable)` shadows, while active, on the instances among
`layers` (restored on exit; every other layer, and every other call, as written):

- each exact GELU activation (`_gelu.keeping_input`): keeps only its input;
- each plain `LayerNormalization` (`_layer_norm.keeping_input`): keeps only its
  input, its gradient in closed form;
- each plain `Dense` (`plain_dense`: Keras 3's or tf_keras's own class, float, not
  quantized, no LoRA, no autocast) whose input is the output of one of those
  computes its input again, after the incoming gradient, for its kernel's gradient
  -- so the input is not kept a second time for the product: a LayerNorm's output
  by the layer's own call on its kept input (`matmul_recomputing_input`); a GELU's
  as `_gelu.gelu_matmul` over the GELU's input, one gradient through the GELU and
  the product that shares one `erfc` pass between the GELU's output and its
  derivative (`_gelu.with_erfc`);
- each plain `Dense` or `EinsumDense` (`plain_einsum_dense`: the family's own class, as
  `plain_dense`, an equation whose gradients are two plain einsums) fed the output of a
  lean LayerNorm of an *earlier* block's call -- a block's output feeding the next block's
  query, key and value projections -- makes it again for its kernel's gradient from the
  LayerNorm's kept input (`remake_of`: the output carries its `remake`;
  `einsum_recomputing_input`), so the block's input is not kept a second time (1.5 MiB
  per sample per block at BERT-base, seq 512; made again once for the three projections,
  `remade_after`: the LayerNorm's elementwise pass, once a block). Not inside a `tf.cond`
  branch or a loop body (`_tf.in_control_flow_body`), whose gradient cannot read the
  LayerNorm's weights anew, nor for a projection whose kernel's dtype is not its input's;
- each plain `Dropout` (`plain_dropout`: the family's own class, no noise shape, a rate
  between 0 and 1) of the block itself (not an attention layer's: the attention core
  keeps its own as bits) keeps its decision as bits, 1 per entry, where autodiff keeps
  it as bools, 8 per entry (`keeping_bits`): the same random numbers, drawn by the
  layer's own call on ones of the input's shape.

In a post-LayerNorm block (`x -> attention -> + x -> LayerNorm -> y -> Dense +
GELU -> h, g -> Dense -> + y -> LayerNorm`) this keeps, of the feed-forward, the
first LayerNorm's input and the GELU's input `h`, where TensorFlow's autodiff
keeps the LayerNorm's input and its scaled inverse deviation, `y`, four GELU
tensors and `g` (docs/attention.md, "What `"attention"` keeps on TensorFlow"); of the
attention, `q`, `k`, `v` and the core's output, not the block's input `x` where an
earlier block's lean LayerNorm made it (docs/attention.md, "The block's input made
again").
The forward values are the layers' own; the gradients equal autodiff's to float
rounding (the statistics computed again, the sums in another order), which is
`"attention"`'s promise (`"full"` leaves every layer as written).

Used alone, by bert4keras's patch: `remaking_input` (an attention layer's `Dense` layers
fed a LayerNormalization unit's output make it again) and `dropout_call` (the model's own
`Dropout` layers keep bits).
"""

import contextlib

import tensorflow as tf

from ..adapters import _keras_private, _mha_private, _tf, _tf_keras
from ..engine._core import after
from .._scoped import shadowed
from . import _flash_tf, _gelu, _layer_norm

_MARK = "__recompute_lean__"


def matmul_recomputing_input(x, kernel, recompute, forward):
    """`forward(kernel)` -- the product `x @ kernel` as the layer computes it -- under a
    gradient that keeps the kernel and not `x`: `recompute(gate)` makes `x` again once
    `gate` (the incoming gradient) exists, for the kernel's gradient; `x`'s gradient is
    the incoming one times the kernel, transposed."""

    @tf.custom_gradient
    def product(x, kernel):
        def gradient(dy):
            d_kernel = _gelu.kernel_gradient(recompute(dy), dy, kernel)
            return _gelu.matmul_last(dy, kernel, transpose_b=True), d_kernel

        return forward(kernel), gradient

    return product(x, kernel)


def remade_after(call, x):
    """`remake(gate)` for `matmul_recomputing_input`: `call(x)` made again once `gate` (the
    incoming gradient) exists (`after`), not in the forward pass. Made once per graph the
    gradients are built in (eagerly: once), for every product fed it (a block's output
    feeds the next block's query, key and value projections): the first product's
    gradient gates it, the others read it."""
    made = {}  # graph (None: eager) -> x made again there

    def remake(gate):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if graph not in made:
            made[graph] = call(after([x], gate)[0])
        return made[graph]

    return remake


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


def _plain(layer, classes):
    """`classes[(module, name)]` of `layer`'s class where `layer` is plain: the family's own
    class, not quantized, no LoRA, no autocast, no `call` of the instance's own; else None."""
    cls = type(layer)
    found = classes.get((cls.__module__, cls.__name__))
    if found is None or "call" in vars(layer) or getattr(layer, "quantization_mode", None) \
            or getattr(layer, "lora_enabled", False) or layer.compute_dtype != layer.dtype:
        return None
    return found


def plain_dense(layer):
    """`(product, rest)` of `_DENSES` for a plain float `Dense` (the family's own class, not
    quantized, no LoRA, no autocast, no `call` of the instance's own), else None."""
    return _plain(layer, _DENSES)


class _Made:
    """The outputs of the lean GELUs and LayerNorms of one block's call, each with the
    product a `Dense` fed by it computes under a gradient that makes the output again
    (`fused(kernel, forward)`: `forward(kernel)`, the layer's own product, as its value).

    A lean LayerNorm's output also carries its `remake(gate)` as an attribute
    (`_REMADE`), beyond the block's call: a later block's `Dense` or `EinsumDense` layers
    fed it (the next block's query, key and value projections, fed the previous block's
    output) make it again from the LayerNorm's kept input, found by `remake_of`."""

    def __init__(self):
        self.outputs = {}  # id(output) -> (output, fused)

    def add(self, output, fused):
        if getattr(output, "dtype", None) in _gelu.FLOATS:
            self.outputs[id(output)] = (output, fused)
        return output

    def add_remade(self, output, remake):
        """`add` for an output that `remake(gate)` makes again: the `Dense` fed it computes
        its product under `matmul_recomputing_input`, not keeping it."""
        if getattr(output, "dtype", None) in _gelu.FLOATS:
            setattr(output, _REMADE, remake)
        return self.add(output, _remaking(output, remake))

    def fused_of(self, x):
        """The `fused` of a recorded output `x`, or of one an earlier block's lean LayerNorm
        made (`remake_of`), else None."""
        found = self.outputs.get(id(x))
        if found is not None and found[0] is x:
            return found[1]
        remake = remake_of(x)
        return None if remake is None else _remaking(x, remake)


_REMADE = "__recompute_remade__"  # on a lean LayerNorm's output: its `remake(gate)`


def _remaking(x, remake):
    """The `fused(kernel, forward)` of a `Dense` fed `x`, which `remake(gate)` makes again."""
    return lambda kernel, forward: matmul_recomputing_input(x, kernel, remake, forward)


def remake_of(x):
    """The `remake(gate)` of a lean LayerNorm's output `x` (any block's), else None."""
    return getattr(x, _REMADE, None) if isinstance(x, tf.Tensor) else None


def _gelu_activation(made):
    def keep(own):
        kept = _gelu.keeping_input(own)

        def activation(x):
            # one gradient through the GELU and the product, one erfc pass (`with_erfc`)
            h = tf.convert_to_tensor(x)
            return made.add(kept(x), lambda kernel, forward: _gelu.gelu_matmul(
                h, kernel, _gelu.with_erfc, forward))

        setattr(activation, _MARK, True)
        return activation

    return keep


def _norm_call(layer, own_call, made, tf_variable):
    def lean(inputs, *args, **kwargs):
        if args or kwargs or not _layer_norm.applies(layer, inputs):
            return own_call(inputs, *args, **kwargs)
        y = _layer_norm.keeping_input(layer, own_call, inputs, tf_variable)
        if _tf.in_control_flow_body():
            return y  # (made again, it would read gamma and beta in a gradient of a
            #          `tf.cond` branch or loop body, which cannot capture them: kept)
        return made.add_remade(y, remade_after(own_call, inputs))

    setattr(lean, _MARK, True)
    return lean


def _dense_call(layer, own_call, made, product, rest):
    def lean(inputs, *args, **kwargs):
        fused = made.fused_of(inputs)
        if fused is None or inputs.dtype != layer.kernel.dtype:
            return own_call(inputs, *args, **kwargs)
        return rest(layer, fused(tf.convert_to_tensor(layer.kernel), product(inputs)))

    setattr(lean, _MARK, True)
    return lean


def einsum_gradient_equations(equation):
    """`(input's, kernel's)`: the equations of `tf.einsum` that give the input's and the
    kernel's gradients of `einsum(equation, x, kernel)` from the output's `dy` (`"Y,K->X"`,
    `"X,Y->K"`); None where they are not that simple (an ellipsis, a letter twice in one
    operand, a letter of one operand in neither the other nor the output)."""
    if not isinstance(equation, str) or "..." in equation or equation.count("->") != 1:
        return None
    operands, y = equation.replace(" ", "").split("->")
    if operands.count(",") != 1:
        return None
    x, k = operands.split(",")
    if not all(len(set(t)) == len(t) and t.isalpha() for t in (x, k, y)):
        return None
    if not set(x) <= set(k) | set(y) or not set(k) <= set(x) | set(y) \
            or not set(y) <= set(x) | set(k):
        return None
    return f"{y},{k}->{x}", f"{x},{y}->{k}"


def einsum_recomputing_input(x, kernel, equations, remake, forward):
    """`forward(kernel)` -- an `EinsumDense`'s product `einsum(equation, x, kernel)` as the
    layer computes it -- under a gradient that keeps the kernel and not `x`:
    `remake(gate)` makes `x` again once `gate` (the incoming gradient) exists, for the
    kernel's gradient. `equations`: `einsum_gradient_equations(equation)`."""
    input_equation, kernel_equation = equations

    @tf.custom_gradient
    def product(x, kernel):
        def gradient(dy):
            d_kernel = tf.einsum(kernel_equation, remake(dy), dy)
            return tf.einsum(input_equation, dy, kernel), d_kernel

        return forward(kernel), gradient

    return product(x, kernel)


def _keras3_einsum(layer, x):
    """`keras.layers.EinsumDense`'s product of `x`, as a function of the kernel."""
    from keras import ops

    return lambda kernel: ops.einsum(layer.equation, x, kernel)


def _tf_keras_einsum(layer, x):
    """`tf_keras.layers.EinsumDense`'s product of `x`, as a function of the kernel."""
    return lambda kernel: tf.einsum(layer.equation, x, kernel)


def _tf_keras_einsum_rest(layer, y):
    """The rest of `tf_keras.layers.EinsumDense.call` after its product `y`."""
    if layer.bias is not None:
        y += layer.bias
    return layer.activation(y) if layer.activation is not None else y


# The plain `EinsumDense` of each family, (module, name): (its product, the rest of its call)
_EINSUM_DENSES = {
    _keras_private.EINSUM_DENSE: (_keras3_einsum, _keras3_rest),
    _tf_keras.EINSUM_DENSE: (_tf_keras_einsum, _tf_keras_einsum_rest),
}


def plain_einsum_dense(layer):
    """`(product, rest)` of `_EINSUM_DENSES` for a plain float `EinsumDense` (as
    `plain_dense`) whose equation has simple gradients (`einsum_gradient_equations`),
    else None."""
    found = _plain(layer, _EINSUM_DENSES)
    if found is None or einsum_gradient_equations(layer.equation) is None:
        return None
    return found


def _einsum_dense_call(layer, own_call, product, rest):
    equations = einsum_gradient_equations(layer.equation)

    def lean(inputs, *args, **kwargs):
        remake = remake_of(inputs)
        if remake is None or args or set(kwargs) - {"training"} \
                or inputs.dtype != layer.kernel.dtype:
            return own_call(inputs, *args, **kwargs)  # (mixed dtypes: the layer promotes)
        y = einsum_recomputing_input(inputs, tf.convert_to_tensor(layer.kernel), equations,
                                     remake, product(layer, inputs))
        return rest(layer, y)

    setattr(lean, _MARK, True)
    return lean


@contextlib.contextmanager
def remaking_input(denses, x, remake):
    """While active, each plain `Dense` among `denses` (`plain_dense`) that is fed `x`
    computes its product under a gradient that makes `x` again, `remake(gate)` once the
    incoming gradient `gate` exists, for its kernel's gradient, instead of keeping `x`
    (`matmul_recomputing_input`); fed anything else it runs as written. For a tensor
    another layer can make again from what it keeps (bert4keras's LayerNormalization
    units feeding an attention layer's query, key and value `Dense` layers)."""
    made = _Made()
    made.add_remade(x, remake)
    found = ((layer, plain_dense(layer)) for layer in denses)
    with shadowed([(layer, "call", _dense_call(layer, layer.call, made, *f))
                   for layer, f in found if f is not None]):
        yield


_DROPOUTS = (_keras_private.DROPOUT, _tf_keras.DROPOUT)


def plain_dropout(layer):
    """True for the family's own `Dropout` class (no `call` of the instance's own), no noise
    shape, a rate strictly between 0 and 1."""
    cls = type(layer)
    rate = getattr(layer, "rate", None)
    return ((cls.__module__, cls.__name__) in _DROPOUTS and "call" not in vars(layer)
            and getattr(layer, "noise_shape", None) is None
            and isinstance(rate, float) and 0.0 < rate < 1.0)


def keeping_bits(x, draw, rate):
    """`Dropout(rate)(x, training=True)` whose gradient keeps the decision as bits: `draw(ones)`
    is the layer's own call on ones of `x`'s shape and dtype (its random numbers, drawn
    once); the output is `where(keep, x * scale, 0)` and the gradient `where(keep, dy, 0) *
    scale`, TensorFlow's dropout and its autodiff op for op."""

    @tf.custom_gradient
    def dropped(x):
        zero = tf.zeros([], x.dtype)
        keep = tf.not_equal(draw(tf.ones_like(x)), zero)
        scale = tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype)
        bits = _flash_tf.pack(keep)

        def gradient(dy):
            kept = _flash_tf.ENGINE.unpack(after([bits], dy)[0], x.shape[-1])
            return tf.where(kept, dy, tf.zeros([], dy.dtype)) * scale

        return tf.where(keep, x * scale, zero), gradient

    return dropped(x)


def dropout_call(layer, own_call):
    """`layer`'s call (`own_call`) keeping its decision as bits in training (`keeping_bits`):
    as written for anything else (not training, extra arguments, no known last axis)."""
    def lean(inputs, training=None, **kwargs):
        if (training is not True or kwargs or not isinstance(inputs, tf.Tensor)
                or inputs.dtype not in _gelu.FLOATS or inputs.shape.rank in (None, 0)
                or inputs.shape[-1] is None):
            return own_call(inputs, training=training, **kwargs)
        return keeping_bits(inputs, lambda ones: own_call(ones, training=True), layer.rate)

    setattr(lean, _MARK, True)
    return lean


def _block_dropouts(layers):
    """The plain `Dropout` layers among `layers` but the attention layers' own."""
    owned = {id(_mha_private.own_dropout(layer)) for layer in layers}
    return [layer for layer in layers if plain_dropout(layer) and id(layer) not in owned]


@contextlib.contextmanager
def lean_layers(layers, tf_variable):
    """While active, the exact GELUs, plain LayerNorms, plain `Dense` and plain `Dropout`
    layers among `layers` keep less (the module docstring). `tf_variable(w)`: the
    `tf.Variable` behind one of the family's weights."""
    made = _Made()
    denses = ((layer, plain_dense(layer)) for layer in layers)
    einsums = ((layer, plain_einsum_dense(layer)) for layer in layers)
    norms = (layer for layer in layers if _layer_norm.plain_norm(layer))
    with _gelu.kept_input(layers, _gelu_activation(made)), shadowed(
            [(layer, "call", _norm_call(layer, layer.call, made, tf_variable)) for layer in norms]
            + [(layer, "call", _dense_call(layer, layer.call, made, *found))
               for layer, found in denses if found is not None]
            + [(layer, "call", _einsum_dense_call(layer, layer.call, *found))
               for layer, found in einsums if found is not None]
            + [(layer, "call", dropout_call(layer, layer.call))
               for layer in _block_dropouts(layers)]):
        try:
            yield
        finally:
            made.outputs.clear()
