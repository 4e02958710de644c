"""`AccumOptimizer` for tf_keras new-style optimizers (`tf_keras.optimizers.*`)."""

import contextlib
import warnings

import tensorflow as tf
import tf_keras

from . import _backends, _batchnorm, _distributed, _validation, _window
from ._base import AccumOptimizer, check_optimizer, claim_inner


def inner_loss_scale_state(optimizer):
    """The dynamic loss-scale state of a tf_keras `LossScaleOptimizer`, or None.

    tf_keras exposes the current scale only as a tensor (`loss_scale`); the
    variables live in the optimizer's `_loss_scale` state object.
    """
    if getattr(optimizer, "dynamic", False) and hasattr(optimizer, "get_unscaled_gradients"):
        return optimizer._loss_scale
    return None


def warn_pending(optimizer):
    """Warns once (per optimizer) about micro-steps pending at the end of `fit`."""
    if not optimizer._built_accum or optimizer._warned_pending or not tf.executing_eagerly():
        return
    pending = int(optimizer.window_steps.numpy())
    if pending:
        optimizer._warned_pending = True
        warnings.warn(
            f"AccumOptimizer: {pending} micro-step(s) of an incomplete window "
            f"(steps_per_update={optimizer.steps_per_update}) are pending at the end "
            "of training. They stay in the buffer and join the next window; call "
            "`optimizer.flush()` to apply them now, or pass "
            "`callbacks=[optimizer.flush_callback()]` to `fit`.",
            stacklevel=3,
        )


@contextlib.contextmanager
def masked_updates(optimizer, variables, touched):
    """Guards the innermost new-style optimizer's per-variable update (`_update_step`,
    `_update_step_xla`) and its weight decay with the variables' touched flags while
    the update is traced (instance attributes, removed after), so an untouched
    variable and its slots stay as they are, as if it had no gradient."""
    innermost = optimizer
    while getattr(innermost, "inner_optimizer", None) is not None:
        innermost = innermost.inner_optimizer
    flags = {innermost._var_key(v): t for v, t in zip(variables, touched)}

    def touched_of(variable):
        return flags.get(innermost._var_key(variable))

    update_step, update_step_xla = innermost._update_step, innermost._update_step_xla
    hooks = {
        "_update_step": lambda gradient, variable: _window.guarded(
            touched_of(variable), lambda: update_step(gradient, variable)
        ),
        "_update_step_xla": lambda gradient, variable, key: _window.guarded(
            touched_of(variable), lambda: update_step_xla(gradient, variable, key)
        ),
        "_apply_weight_decay": lambda variables: _window.masked_weight_decay(
            innermost, variables, touched_of
        ),
    }
    with _window.instance_hooks(innermost, hooks):
        yield


@tf_keras.saving.register_keras_serializable(package="accum", name="AccumOptimizer")
class TFKerasAccumOptimizer(AccumOptimizer, tf_keras.optimizers.Optimizer):
    """`AccumOptimizer` wrapping a tf_keras optimizer; see `accum.AccumOptimizer`."""

    _FAMILY = _backends.TF_KERAS

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        if check_optimizer(optimizer) != self._FAMILY:
            raise ValueError(
                "This `AccumOptimizer` class wraps tf_keras (new-style) optimizers; "
                "build it with `accum.AccumOptimizer(optimizer, steps_per_update)`. "
                f"Received: optimizer={optimizer!r}"
            )
        steps_per_update = _validation.check_steps_per_update(steps_per_update)
        mode = _validation.check_mode(mode)
        kwargs.pop("is_legacy_optimizer", None)
        if kwargs:
            raise ValueError(
                f"AccumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. "
                "Set them on the inner optimizer."
            )
        rule = None
        if mode == "momentum":
            from ._momentum_tf_keras import rule_for

            rule = rule_for(optimizer)
        super().__init__(name=name or "AccumOptimizer")
        self.inner_optimizer = optimizer
        self._steps_per_update = steps_per_update
        self.mode = mode
        self._rule = rule
        self._warned_pending = False
        self._built_accum = False
        # Created here, not in `build`: tf_keras caches an optimizer's checkpoint
        # children the first time they are listed (a restore before the first
        # step), so containers must exist from the start. `build` fills them.
        with tf.init_scope():
            self.window_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="window_steps")
            # Replica-local under a strategy (see `accum._distributed`).
            with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                self.window_count = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="window_count"
                )
        self._variables += [self.window_steps, self.window_count]
        self.accumulators = []
        # One flag per variable: did the window give it a gradient (`accum._window`).
        self.touched = []
        self._model_variables = self._no_dependency([])
        claim_inner(self, optimizer)

    # ------------------------------------------------------------------ state

    def build(self, var_list):
        """Creates counters, buffers (`mode="buffer"`) and the inner optimizer's slots."""
        if self._built_accum:
            return
        var_list = list(var_list)
        self._accum_strategy = _distributed.current_strategy()
        if self._accum_strategy is not None and self.mode != "buffer":
            raise _distributed.momentum_not_supported()
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._model_variables.extend(var_list)
        with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
            # One name per flag: tf_keras's `.h5` files key optimizer variables by name.
            first = len(self.touched)
            self.touched.extend(
                self.add_variable(shape=(), dtype=tf.int64, name=f"touched_{first + i}")
                for i in range(len(var_list))
            )
        if self.mode == "buffer":
            with _distributed.replica_local_variables():
                self.accumulators.extend(
                    self.add_variable_from_reference(v, "accumulator") for v in var_list
                )
        else:
            self._rule.check_built(self.inner_optimizer, var_list)
        self._built = True
        self._built_accum = True
        _batchnorm.warn_for_training_model(self)

    def _create_iteration_variable(self):
        # The micro-step counter (tf_keras's `_iterations` of the wrapper) is
        # named `micro_steps`, not `iteration` like the inner optimizer's: `.h5`
        # files store optimizer variables under their names, which must differ.
        with tf.init_scope():
            self._iterations = tf.Variable(0, name="micro_steps", dtype=tf.int64, trainable=False)
        self._variables.append(self._iterations)

    @property
    def variables(self):
        """The wrapper's variables (counters, buffers) followed by the inner optimizer's."""
        return list(self._variables) + list(self.inner_optimizer.variables)

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

    def _has_window_state(self):
        return self._built_accum

    def _model_variables_list(self):
        return self._model_variables

    def _micro_steps_variable(self):
        return self._iterations

    @property
    def iterations(self):
        """Applied updates: the inner optimizer's `iterations`."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (settable, for LR callbacks)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def lr(self):
        """Alias of `learning_rate` (tf_keras LR callbacks use it)."""
        return self.inner_optimizer.learning_rate

    @lr.setter
    def lr(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def compute_gradients(self, loss, var_list, tape=None):
        """The inner optimizer's gradients (a `LossScaleOptimizer` scales and unscales)."""
        return self.inner_optimizer.compute_gradients(loss, var_list, tape=tape)

    def get_scaled_loss(self, loss):
        """The inner `LossScaleOptimizer`'s scaled loss (`loss` if there is none)."""
        scale = getattr(self.inner_optimizer, "get_scaled_loss", None)
        return scale(loss) if scale else loss

    def get_unscaled_gradients(self, grads):
        """The inner `LossScaleOptimizer`'s unscaled gradients (`grads` if there is none)."""
        unscale = getattr(self.inner_optimizer, "get_unscaled_gradients", None)
        return unscale(grads) if unscale else grads

    # --------------------------------------------------------------- updates

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """One micro-step: accumulates the gradients; every `steps_per_update`-th call updates."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if not grads_and_vars:
            return self._iterations
        with tf.init_scope():
            self.build([v for _, v in grads_and_vars])
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        aggregate = kwargs.pop("experimental_aggregate_gradients", True) and not skip_gradients_aggregation
        accumulate_locally = self._accumulates_locally()
        if aggregate and not accumulate_locally:
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        if accumulate_locally and not aggregate:
            grads_and_vars = _distributed.local_share(self, grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        indices = tuple(self._variable_index(v) for v in variables)
        with tf.name_scope(name or self.name):
            if accumulate_locally:
                # Each replica accumulates its own gradients; one all-reduce per
                # update (`accum._distributed`). `skip_gradients_aggregation`
                # (gradients already reduced by the caller) is not supported here.
                if self.mode != "buffer":
                    raise _distributed.momentum_not_supported()
                return self._distributed_window().micro_step(grads, indices)
            if self.steps_per_update == 1 and self.mode == "buffer":
                self.inner_optimizer.apply_gradients(
                    list(zip(grads, variables)), skip_gradients_aggregation=True
                )
            else:
                if self.mode == "buffer":
                    self._accumulate(grads, indices)
                else:
                    self._rule.accumulate(self, grads, indices)
                _window.maybe_end_window(
                    self.steps_per_update, self.window_steps, self._end_window
                )
            if _distributed.in_replica_context():
                # A mirrored counter is written in the cross-replica context.
                return tf.distribute.get_replica_context().merge_call(
                    lambda _: self._iterations.assign_add(1)
                )
            return self._iterations.assign_add(1)

    def _accumulates_locally(self):
        """Under a strategy (replica context), gradients are accumulated unreduced."""
        return _distributed.in_replica_context() and not (
            self.steps_per_update == 1 and self.mode == "buffer"
        )

    def aggregate_gradients(self, grads_and_vars):
        """All-reduces gradients, except when they are accumulated locally under a strategy
        (the reduction then happens once per update: `accum._distributed`)."""
        if self._accumulates_locally():
            return list(grads_and_vars)
        return super().aggregate_gradients(grads_and_vars)

    def _distributed_window(self):
        """The `accum._distributed.Window` of this optimizer (see there)."""
        state = inner_loss_scale_state(self.inner_optimizer)

        def on_skip():
            # What the inner LossScaleOptimizer does with a non-finite step.
            state.counter.assign(0)
            state.current_loss_scale.assign(tf.maximum(state.current_loss_scale * 0.5, 1.0))

        return _distributed.Window(
            self,
            buffers=lambda indices: [self.accumulators[i] for i in indices],
            all_buffers=lambda: self.accumulators,
            destinations=lambda indices: [self._model_variables[i] for i in indices],
            window_steps=lambda: self.window_steps,
            window_count=lambda: self.window_count,
            micro_steps=lambda: self._iterations,
            apply_inner=self._apply_mean_gradients,
            on_skip=None if state is None else on_skip,
            touched=lambda indices: [self.touched[i] for i in indices],
        )

    def _variable_index(self, variable):
        key = self._var_key(variable)
        if key not in self._index_dict:
            raise ValueError(
                f"Unknown variable: {variable.name}. This optimizer can only be called "
                "for the variables it was originally built with."
            )
        return self._index_dict[key]

    def _accumulate(self, grads, indices):
        state = inner_loss_scale_state(self.inner_optimizer)

        def on_skip():
            # What the inner LossScaleOptimizer does with a non-finite step.
            state.counter.assign(0)
            state.current_loss_scale.assign(
                tf.maximum(state.current_loss_scale * 0.5, 1.0)
            )

        _window.accumulate(
            [self.accumulators[i] for i in indices],
            grads,
            self.window_steps,
            self.window_count,
            on_skip=None if state is None else on_skip,
            touched=[self.touched[i] for i in indices],
        )

    def _end_window(self):
        if self.mode == "buffer":
            _window.end_window(
                self.accumulators, self.window_steps, self.window_count, self._apply_mean,
                touched=self.touched,
            )
        else:
            _window.end_window(
                [], self.window_steps, self.window_count, lambda: self._rule.finish(self),
                touched=self.touched,
            )

    def _apply_mean(self):
        grads = _window.mean_gradients(self.accumulators, self.window_count)
        indices = tuple(range(len(self._model_variables)))
        self._apply_mean_gradients(grads, indices, _window.touched_mask(self.touched))

    def _apply_mean_gradients(self, grads, indices, touched):
        """The inner optimizer's update of the variables `indices`, where only those
        whose `touched` (scalar bool tensors) is true change."""
        variables = [self._model_variables[i] for i in indices]
        restore = _window.protect_untouched(variables, touched)
        with masked_updates(self.inner_optimizer, variables, touched):
            self.inner_optimizer.apply_gradients(
                list(zip(grads, variables)), skip_gradients_aggregation=True
            )
        restore()

    def flush(self):
        """Applies the pending partial window now, normalized by the micro-batches it holds.

        Does nothing if the window is empty or the optimizer is not built. The
        variables updated are those that got a gradient in some micro-step of
        the window. Works eagerly and inside `tf.function`.
        """
        if not self._built_accum:
            return
        if getattr(self, "_accum_strategy", None) is not None:
            indices = tuple(range(len(self._model_variables)))
            self._distributed_window().flush(self._accum_strategy, indices)
            return
        _window.flush(self.window_steps, self._end_window)

    def finalize_variable_values(self, var_list):
        """End of `fit`: warns once about a pending partial window; the inner optimizer finalizes (EMA)."""
        warn_pending(self)
        self.inner_optimizer.finalize_variable_values(var_list)

    # --------------------------------------------------------- serialization

    @classmethod
    def _deserialize_inner(cls, config, custom_objects):
        return tf_keras.optimizers.deserialize(
            config, custom_objects=custom_objects, use_legacy_optimizer=cls._FAMILY == _backends.TF_KERAS_LEGACY
        )

    def _serialize_inner(self):
        return tf_keras.optimizers.serialize(self.inner_optimizer)
