"""`AccumOptimizer` for tf_keras new-style optimizers (`tf_keras.optimizers.*`)."""

import contextlib

import tensorflow as tf
import tf_keras

from .. import _families, _shadow
from .._base import AccumOptimizer, claim_inner
from ..batchnorm import _warning
from ..modes import _distributed, _window
from ._common import TFKerasWindow
from . import _inner


@contextlib.contextmanager
def masked_updates(optimizer, variables, touched):
    """Guards the innermost new-style optimizer's per-variable updates
    (`accum.tf_keras._inner.UPDATE_STEPS`) and its weight decay with the variables' touched flags while
    the update is traced (instance attributes, removed after), so an untouched
    variable and its slots stay as they are, as if it had no gradient."""
    innermost = optimizer
    while getattr(innermost, "inner_optimizer", None) is not None:
        innermost = innermost.inner_optimizer
    flags = {_inner.var_key(innermost, v): t for v, t in zip(variables, touched)}

    def touched_of(variable):
        return flags.get(_inner.var_key(innermost, variable))

    hooks = _window.masked_update_hooks(_inner, innermost, touched_of)
    with _shadow.shadowed(innermost, hooks):
        yield


@tf_keras.saving.register_keras_serializable(package="accum", name="AccumOptimizer")
class TFKerasAccumOptimizer(TFKerasWindow, AccumOptimizer, tf_keras.optimizers.Optimizer):
    """`AccumOptimizer` wrapping a tf_keras optimizer; see `accum.AccumOptimizer`."""

    _FAMILY = _families.TF_KERAS
    _FAMILY_DESCRIPTION = "tf_keras (new-style)"
    _INNER_API = _inner  # the inner optimizer's private API (`accum._inner`)
    _NO_AGGREGATION = {"skip_gradients_aggregation": True}

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        kwargs.pop("is_legacy_optimizer", None)
        steps_per_update, mode, rule = self._checked(optimizer, steps_per_update, mode, kwargs)
        super().__init__(name=name or "AccumOptimizer")
        self.inner_optimizer = optimizer
        self._init_window(steps_per_update, mode, rule)
        self._built_accum = False
        # Created here, not in `build`: tf_keras caches an optimizer's checkpoint
        # children the first time they are listed (a restore before the first
        # step), so containers must exist from the start. `build` fills them.
        with tf.init_scope():
            self.window_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="window_steps")
            # Replica-local under a strategy (see `accum.modes._distributed`).
            with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                self.window_count = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="window_count"
                )
        _inner.own_variables(self).extend([self.window_steps, self.window_count])
        self.accumulators = []
        # One flag per variable: did the window give it a gradient (`accum.modes._window`).
        self.touched = []
        self._model_variables = _inner.untracked(self, [])
        claim_inner(self, optimizer)

    # ------------------------------------------------------------------ state

    def build(self, var_list):
        """Creates counters, buffers (`mode="buffer"`) and the inner optimizer's slots."""
        if self._built_accum:
            return
        var_list = list(var_list)
        self._begin_build(var_list)
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._model_variables.extend(var_list)
        with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
            # One name per flag: tf_keras's `.h5` files key optimizer variables by name.
            first = len(self.touched)
            self.touched.extend(
                self.add_variable(shape=(), dtype=tf.int64, name=f"touched_{first + i}")
                for i in range(len(var_list) if self._mode.flags_touched else 0)
            )
        if self._mode.buffered:
            with _distributed.replica_local_variables():
                self.accumulators.extend(
                    self.add_variable_from_reference(v, "accumulator") for v in var_list
                )
        self._mode.check_built(self._ops, self.inner_optimizer, var_list)
        _inner.mark_built(self)
        self._built_accum = True
        self._select_steps()
        self._link_batch_norm(var_list)
        _warning.warn_for_training_model(self)
        self._guard_recompile()

    def _create_iteration_variable(self):
        # The micro-step counter (tf_keras's `_iterations` of the wrapper) is
        # named `micro_steps`, not `iteration` like the inner optimizer's: `.h5`
        # files store optimizer variables under their names, which must differ.
        with tf.init_scope():
            _inner.set_own_iterations(
                self, tf.Variable(0, name="micro_steps", dtype=tf.int64, trainable=False))
        _inner.own_variables(self).append(_inner.own_iterations(self))

    @property
    def variables(self):
        """The wrapper's variables (counters, buffers) followed by the inner optimizer's."""
        return list(_inner.own_variables(self)) + list(self.inner_optimizer.variables)

    def set_weights(self, weights):
        """Sets `variables` (the wrapper's, then the inner optimizer's) from a list of arrays,
        as tf_keras's `.h5` loading does; the lengths and shapes must match."""
        if not self._built_accum:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been "
                "built. Call `optimizer.build(trainable_variables)` first."
            )
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"AccumOptimizer: expected {len(variables)} weights (counters, "
                "accumulation buffers, then the inner optimizer's variables). "
                f"Received: {len(weights)} weights."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(weight.shape):
                raise ValueError(
                    f"AccumOptimizer: variable {variable.name} has shape "
                    f"{tuple(variable.shape)}. Received: a weight of shape {tuple(weight.shape)}."
                )
            variable.assign(weight)

    def _micro_steps_variable(self):
        return _inner.own_iterations(self)

    def compute_gradients(self, loss, var_list, tape=None):
        """The inner optimizer's gradients (a `LossScaleOptimizer` scales and unscales)."""
        return self.inner_optimizer.compute_gradients(loss, var_list, tape=tape)

    # --------------------------------------------------------------- updates

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """One micro-step: accumulates the gradients; every `steps_per_update`-th call updates."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if not grads_and_vars:
            return _inner.own_iterations(self)
        with tf.init_scope():
            self.build([v for _, v in grads_and_vars])
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        aggregate = kwargs.pop("experimental_aggregate_gradients", True) and not skip_gradients_aggregation
        return self._micro_step(grads_and_vars, name, aggregate)

    def _count_micro_step(self):
        if _distributed.in_replica_context():
            # A mirrored counter is written in the cross-replica context.
            return tf.distribute.get_replica_context().merge_call(
                lambda _: _inner.own_iterations(self).assign_add(1)
            )
        return _inner.own_iterations(self).assign_add(1)

    def aggregate_gradients(self, grads_and_vars):
        """All-reduces gradients unless they are accumulated locally (`_aggregated_unless_local`)."""
        return self._aggregated_unless_local(grads_and_vars, super().aggregate_gradients)

    def _aggregated(self, grads_and_vars):
        return self.aggregate_gradients(grads_and_vars)

    def _masked_updates(self, variables, touched):
        return masked_updates(self.inner_optimizer, variables, touched)

    def _variable_index(self, variable):
        key = _inner.var_key(self, variable)
        if key not in _inner.own_index(self):
            raise ValueError(
                f"Unknown variable: {variable.name}. This optimizer can only be called "
                "for the variables it was originally built with."
            )
        return _inner.own_index(self)[key]

    def finalize_variable_values(self, var_list):
        """End of `fit`: warns once about a pending partial window; the inner optimizer finalizes (EMA)."""
        self._warn_pending()
        self.inner_optimizer.finalize_variable_values(var_list)
