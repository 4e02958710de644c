"""LayerNormalization whose gradient keeps only its input (TensorFlow, `policy="attention"`).

TensorFlow's autodiff of Keras 3's `LayerNormalization` keeps, per layer, its
input and `rsqrt(variance + epsilon) * gamma` broadcast to the input's shape
(two [seq, hidden] tensors, beside the output its consumer keeps); tf_keras's
fused normalization keeps its input and the normalized values. `keeping_input`
runs the layer's own call (the same forward values) under a gradient that keeps
the input alone and, once the incoming gradient has arrived (`after`), computes
the row statistics again and the gradient in closed form, for `x̂ = (x - mean) *
rsqrt(var + epsilon)` and `y = x̂ * gamma + beta` over the last axis:

    d_x     = rsqrt(var + epsilon) * (g - mean(g) - x̂ * mean(g * x̂)),  g = d_y * gamma
    d_gamma = sum over the other axes of d_y * x̂
    d_beta  = sum over the other axes of d_y

Equal to autodiff's to float rounding (the statistics are computed again, the
sums in another order), which is `"attention"`'s promise; `"full"` leaves the
layers as they are.

`recompute.ops._lean.lean_layers` installs it, while a block's call runs under
`"attention"`, on the plain layers (`plain_norm`: Keras 3's or tf_keras's own
class, float32 or float64 without autocast, no RMS scaling) for inputs over
their last axis (`applies`); any other call runs as written.
"""

import tensorflow as tf

from ..adapters import _keras_private, _tf_keras
from ..engine._core import after

_NORMS = (_keras_private.LAYER_NORMALIZATION, _tf_keras.LAYER_NORMALIZATION)


def plain_norm(layer):
    """True for a layer `keeping_input` computes exactly as its own call: the family's own
    `LayerNormalization` class (no `call` of the instance's own), float32 or float64
    weights and computation, no RMS scaling."""
    cls = type(layer)
    return ((cls.__module__, cls.__name__) in _NORMS and "call" not in vars(layer)
            and not getattr(layer, "rms_scaling", False)
            and layer.compute_dtype == layer.dtype and layer.dtype in ("float32", "float64"))


def applies(layer, x):
    """True if `keeping_input(layer, ..., x)` computes `layer(x)`'s gradient: a tensor of the
    layer's dtype, normalized over its last axis."""
    if not isinstance(x, tf.Tensor) or x.dtype != layer.dtype:
        return False
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    rank = x.shape.rank
    return rank is not None and [a % rank for a in axes] == [rank - 1]


def norm_grad(x, d_y, gamma, epsilon):
    """`(d_x, d_gamma, d_beta)` of `y = x̂ * gamma + beta` over the last axis of `x`
    (`gamma` a tensor or None), from `x` alone (the module docstring's formulas)."""
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    inv = tf.math.rsqrt(variance + tf.cast(epsilon, x.dtype))
    x_hat = centered * inv
    g = d_y * gamma if gamma is not None else d_y
    d_x = inv * (g - tf.reduce_mean(g, axis=-1, keepdims=True)
                 - x_hat * tf.reduce_mean(g * x_hat, axis=-1, keepdims=True))
    others = list(range(x.shape.rank - 1))
    return d_x, tf.reduce_sum(d_y * x_hat, axis=others), tf.reduce_sum(d_y, axis=others)


def keeping_input(layer, own_call, x, tf_variable):
    """`own_call(x)` (the layer's call) under a gradient that keeps only `x` (and the
    layer's `gamma`): `norm_grad` for `x`, `gamma` and `beta` (`tf_variable(w)`: the
    `tf.Variable` behind the family's weight `w`, as the gradient names it)."""
    gamma_value = tf.convert_to_tensor(layer.gamma) if layer.gamma is not None else None
    weights = {"gamma": layer.gamma, "beta": layer.beta}
    refs = {tf_variable(w).ref(): name for name, w in weights.items() if w is not None}

    @tf.custom_gradient
    def normalized(x):
        def gradient(d_y, variables=None):
            d_x, d_gamma, d_beta = norm_grad(after([x], d_y)[0], d_y, gamma_value, layer.epsilon)
            found = {"gamma": d_gamma, "beta": d_beta}
            unknown = [v.name for v in variables or () if v.ref() not in refs]
            if unknown:  # (a gradient of None would be a silent zero)
                raise ValueError(
                    f"recompute: the LayerNormalization '{layer.name}' read variables other "
                    f"than its gamma and beta in its call, whose gradients its lean gradient "
                    f"cannot give. Received: {unknown}")
            return d_x, [found[refs[v.ref()]] for v in variables or ()]

        return own_call(x), gradient

    return normalized(x)
