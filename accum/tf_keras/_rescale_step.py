"""`mode="rescale"` for tf_keras new-style optimizers: one micro-step in TensorFlow ops.

See `accum.modes._rescale` for the recipe. The inner optimizer's own
`apply_gradients` runs at every micro-step, with its moving-average
coefficients, iteration counter, learning rate, weight decay and
per-variable updates (`accum.tf_keras._inner.step_hooks`, `UPDATE_STEPS`) replaced
on the instance while it is traced. tf_keras optimizers assign to the model's
variables directly (no `assign` method to hook), so at a micro-step that is
not the window's last the per-variable update is followed by restoring the
variable's value read before it: one variable-size temporary at a time, no
variable kept. (tf_keras legacy `OptimizerV2`s use fused kernels and are
refused: use their new-style counterparts.)
"""

import tensorflow as tf
import tf_keras

from .. import _shadow
from ..modes import _rescale, _window
from . import _inner as _api


def spec_for(optimizer, k):
    """The `Rescale` of a tf_keras new-style optimizer (or a Keras-style `ValueError`; for a
    legacy one, pointing to its new-style class)."""
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        refuse_legacy(optimizer, k)
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


def micro_step(step, grads, indices):
    """One micro-step of a built tf_keras `AccumOptimizer` (`mode="rescale"`; its state in
    `step`, an `accum.modes._rescale.Step`) with `grads` for its variables at `indices`."""
    spec, inner, variables, micro = step.spec, step.inner, step.variables, step.micro_steps
    grads = step.gradients(indices, grads, tf.zeros_like)
    last = tf.equal((micro + 1) % spec.k, 0)
    # A non-finite micro-step counts as a zero gradient, as a missing one does (the
    # window's update still comes at its last micro-step; `accum.modes._rescale`).
    finite = _window.all_finite(grads)
    grads = [_zeroed_unless(finite, g) for g in grads]
    # The schedule at the update count (the inner optimizer's iterations count updates).
    learning_rate = tf.identity(_api.current_learning_rate(inner))
    # Weight decay at the window's last micro-step, with the update's rate.
    _window.masked_weight_decay(inner, variables, lambda variable: last, _api)

    model = {_api.var_key(inner, v) for v in variables}
    update_step = getattr(inner, _api.UPDATE_STEPS[0])  # the one the others (XLA) run

    def guarded_update_step(gradient, variable, *key):
        def slots_only():
            old = variable.read_value()
            update_step(gradient, variable)
            variable.assign(old)

        if _api.var_key(inner, variable) not in model:
            return update_step(gradient, variable)
        _window.guarded(last, lambda: update_step(gradient, variable))
        _window.guarded(tf.logical_not(last), slots_only)

    hooks = dict(spec.hooks())
    # `apply_gradients` counts the micro-step in `micro`, with the rescaled rate, without
    # weight decay; every per-variable update is guarded.
    hooks.update(_api.step_hooks(inner, micro, spec.learning_rate(learning_rate)))
    hooks.update({name: guarded_update_step for name in _api.UPDATE_STEPS})
    with _shadow.shadowed(inner, hooks):
        result = inner.apply_gradients(list(zip(grads, variables)), skip_gradients_aggregation=True)
    inner.iterations.assign_add(tf.cast(last, inner.iterations.dtype))
    steps = step.window_steps
    steps.assign(tf.where(last, tf.zeros_like(steps), steps + 1))
    step.finish_batch_norm(last)
    return result


def _zeroed_unless(finite, g):
    """`g` where `finite`, else zeros (an `IndexedSlices` keeps its indices)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.where(finite, g.values, tf.zeros_like(g.values)), g.indices, g.dense_shape)
    return tf.where(finite, g, tf.zeros_like(g))
