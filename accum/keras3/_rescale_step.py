"""`mode="rescale"` for Keras 3 (TensorFlow and JAX backends): one micro-step in `keras.ops`.

See `accum.modes._rescale` for the recipe. The inner optimizer's own `apply` runs at
every micro-step with its moving-average coefficients, iteration counter,
learning rate, weight decay and `assign` methods replaced on the instance
while it is traced. Its `assign`, `assign_add` and `assign_sub` select
(`ops.where`) instead of branching: a model variable takes the new value at
the window's last micro-step only, a slot at every micro-step (a non-finite
micro-gradient is replaced by zeros first). The same
code therefore runs eagerly, in `tf.function`, under XLA and in JAX's
functional `stateless_apply`.
"""

import keras
from keras import ops

from .. import _shadow
from ..modes import _rescale, _window
from . import _inner


def spec_for(optimizer, k):
    """The `Rescale` of a Keras 3 optimizer (or a Keras-style `ValueError`)."""
    return _rescale.spec_for(optimizer, k, keras.optimizers, "Keras 3", compute_dtype(keras.config.floatx()))


def compute_dtype(dtype):
    """The dtype a variable of `dtype` holds: on JAX without 64-bit types
    (`jax_enable_x64` off), float64 variables hold float32."""
    dtype = keras.backend.standardize_dtype(dtype)
    if keras.backend.backend() == "jax":
        import jax

        return keras.backend.standardize_dtype(jax.dtypes.canonicalize_dtype(dtype))
    return dtype


def check_variables(spec, variables):
    """`spec.check_variables` for the Keras 3 `variables` the wrapper is built for."""
    spec.check_variables(variables, lambda variable: compute_dtype(variable.dtype))


def _current(variable):
    """The current value of a `keras.Variable` (or of a backend variable)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _dense(variable, value, assign):
    """`value` as a dense tensor for `variable`: TensorFlow `IndexedSlices` are scattered
    into the variable's value (`assign`) or into zeros (`assign_add`/`assign_sub`)."""
    import tensorflow as tf

    if not isinstance(value, tf.IndexedSlices):
        return value
    indices = tf.expand_dims(value.indices, -1)
    values = tf.cast(value.values, variable.dtype)
    if assign:
        return tf.tensor_scatter_nd_update(tf.convert_to_tensor(_current(variable)), indices, values)
    return tf.tensor_scatter_nd_add(tf.zeros(variable.shape, variable.dtype), indices, values)


def micro_step(step, grads, indices):
    """One micro-step of a built Keras 3 `AccumOptimizer` (`mode="rescale"`; its state in
    `step`, an `accum.modes._rescale.Step`) with `grads` for the variables at `indices`."""
    spec, inner, variables, micro = step.spec, step.inner, step.variables, step.micro_steps
    grads = step.gradients(indices, grads, lambda v: ops.zeros(v.shape, v.dtype))
    last = ops.equal(ops.mod(micro.value + 1, spec.k), 0)
    # A non-finite micro-step counts as a zero gradient, as a missing one does (the
    # window's update still comes at its last micro-step; `accum.modes._rescale`).
    finite = ops.all(ops.stack([ops.all(ops.isfinite(_values(g))) for g in grads]))
    grads = [_zeroed_unless(finite, g) for g in grads]
    # The schedule at the update count (the inner optimizer's iterations count updates).
    learning_rate = _inner.current_learning_rate(inner)

    # Weight decay at the window's last micro-step, with the update's rate.
    _inner.weight_decay_where(inner, variables, [last] * len(variables), learning_rate)

    model = {_inner.var_key(inner, v) for v in variables}
    assign = inner.assign

    def selected(variable, new):
        """A model variable takes its new value at the window's last micro-step only."""
        if _inner.var_key(inner, variable) not in model:
            return new
        return ops.where(last, new, _current(variable))

    hooks = dict(spec.hooks())
    # `apply` counts the micro-step in `micro`, with the rescaled rate, without weight decay.
    hooks.update(_inner.step_hooks(inner, micro, spec.learning_rate(learning_rate)))
    hooks.update(
        assign=lambda variable, value: assign(
            variable, selected(variable, _dense(variable, value, assign=True))
        ),
        assign_add=lambda variable, value: assign(
            variable, selected(variable, _current(variable) + ops.cast(_dense(variable, value, False), variable.dtype))
        ),
        assign_sub=lambda variable, value: assign(
            variable, selected(variable, _current(variable) - ops.cast(_dense(variable, value, False), variable.dtype))
        ),
    )
    with _shadow.shadowed(inner, hooks):
        inner.apply(grads, variables)
    inner.iterations.assign(inner.iterations + ops.cast(last, inner.iterations.dtype))
    steps = step.window_steps
    steps.assign(ops.where(last, ops.zeros_like(steps.value), steps.value + 1))
    step.finish_batch_norm(last)


def _values(g):
    return getattr(g, "values", g) if type(g).__name__ == "IndexedSlices" else g


def _zeroed_unless(finite, g):
    """`g` where `finite`, else zeros (an `IndexedSlices` keeps its indices)."""
    values = _values(g)
    zeroed = ops.where(finite, values, ops.zeros_like(values))
    if values is g:
        return zeroed
    import tensorflow as tf

    return tf.IndexedSlices(zeroed, g.indices, g.dense_shape)
