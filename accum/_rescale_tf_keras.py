"""`mode="rescale"` for tf_keras new-style optimizers: one micro-step in TensorFlow ops.

See `accum._rescale` for the recipe. The inner optimizer's own
`apply_gradients` runs at every micro-step, with its moving-average
coefficients, iteration counter, learning rate, weight decay and
per-variable update (`_update_step`, `_update_step_xla`) replaced on the
instance while it is traced. tf_keras optimizers assign to the model's
variables directly (no `assign` method to hook), so at a micro-step that is
not the window's last the per-variable update is followed by restoring the
variable's value read before it: one variable-size temporary at a time, no
variable kept. (tf_keras legacy `OptimizerV2`s use fused kernels and are
refused: use their new-style counterparts.)
"""

import tensorflow as tf
import tf_keras

from . import _rescale, _window


def spec_for(optimizer, k):
    """The `Rescale` of a tf_keras new-style optimizer (or a Keras-style `ValueError`)."""
    return _rescale.spec_for(
        optimizer, k, tf_keras.optimizers, "tf_keras (new-style)", tf_keras.backend.floatx()
    )


def check_variables(spec, variables):
    """`spec.check_variables` for the `tf.Variable`s the wrapper is built for."""
    spec.check_variables(variables, lambda variable: tf.as_dtype(variable.dtype).name)


def refuse_legacy(optimizer, k):
    """tf_keras legacy optimizers: a Keras-style `ValueError` pointing to the new-style class."""
    raise _rescale.unsupported(
        optimizer,
        "tf_keras legacy optimizers apply fused kernels that move the weights at every "
        f"step (use `tf_keras.optimizers.{type(optimizer).__name__}`)",
    )


def micro_step(wrapper, grads, indices):
    """One micro-step of `wrapper` (a built tf_keras `AccumOptimizer`, `mode="rescale"`)
    with `grads` for its variables at `indices`."""
    spec = wrapper._rule
    inner = wrapper.inner_optimizer
    variables = list(wrapper._model_variables)
    grads = _rescale.every_gradient(variables, indices, grads, tf.zeros_like)

    micro = wrapper._iterations
    last = tf.equal((micro + 1) % spec.k, 0)
    # A non-finite micro-step counts as a zero gradient, as a missing one does (the
    # window's update still comes at its last micro-step; `accum._rescale`).
    finite = _window.all_finite(grads)
    grads = [_zeroed_unless(finite, g) for g in grads]
    # The schedule at the update count (the inner optimizer's iterations count updates).
    inner._compute_current_learning_rate()
    learning_rate = tf.identity(inner.learning_rate)
    # Weight decay at the window's last micro-step, with the update's rate.
    _window.masked_weight_decay(inner, variables, lambda variable: last)

    model = {inner._var_key(v) for v in variables}
    update_step = inner._update_step

    def guarded_update_step(gradient, variable):
        def slots_only():
            old = variable.read_value()
            update_step(gradient, variable)
            variable.assign(old)

        if inner._var_key(variable) not in model:
            return update_step(gradient, variable)
        _window.guarded(last, lambda: update_step(gradient, variable))
        _window.guarded(tf.logical_not(last), slots_only)

    hooks = dict(spec.hooks())
    hooks.update(
        _iterations=micro,  # `apply_gradients` counts the micro-step in it
        _compute_current_learning_rate=lambda: None,
        _learning_rate=spec.learning_rate(learning_rate),
        _apply_weight_decay=lambda variables: None,
        _update_step=guarded_update_step,
        _update_step_xla=lambda gradient, variable, key: guarded_update_step(gradient, variable),
    )
    with _window.instance_hooks(inner, hooks):
        result = inner.apply_gradients(list(zip(grads, variables)), skip_gradients_aggregation=True)
    inner.iterations.assign_add(tf.cast(last, inner.iterations.dtype))
    wrapper.window_steps.assign(tf.where(last, tf.zeros_like(wrapper.window_steps), wrapper.window_steps + 1))
    wrapper._finish_batch_norm(last)
    return result


def _zeroed_unless(finite, g):
    """`g` where `finite`, else zeros (an `IndexedSlices` keeps its indices)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.where(finite, g.values, tf.zeros_like(g.values)), g.indices, g.dense_shape)
    return tf.where(finite, g, tf.zeros_like(g))
