"""`AccumOptimizer` for Keras 3 optimizers (TensorFlow backend; `accum.keras3._jax` derives the JAX one)."""

import keras
import tensorflow as tf

from .._base import AccumOptimizer, claim_inner
from ..batchnorm import _warning
from ..modes import _distributed, _momentum, _window
from .. import _families
from . import _buffer_step, _inner, _rescale_step

_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


@keras.saving.register_keras_serializable(package="accum", name="AccumOptimizer")
class Keras3AccumOptimizer(AccumOptimizer, keras.optimizers.Optimizer):
    """`AccumOptimizer` wrapping a Keras 3 optimizer; see `accum.AccumOptimizer`."""

    _FAMILY = _families.KERAS3
    _FAMILY_DESCRIPTION = "Keras 3"
    _RESCALE_STEPS = _rescale_step

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        steps_per_update, mode, rule = self._checked(optimizer, steps_per_update, mode, kwargs)
        super().__init__(learning_rate=0.0, name=name or "accum_optimizer")
        self.inner_optimizer = optimizer
        self._init_window(steps_per_update, mode, rule)
        claim_inner(self, optimizer)

    @staticmethod
    def _momentum_rule_for(optimizer):
        opts = keras.optimizers
        return _momentum.rule_for(optimizer, _inner, (opts.SGD,), (opts.Adam, opts.AdamW))

    def _check_kwargs(self, kwargs):
        """Refuses the base optimizer's arguments (set them on the inner optimizer), unless
        given their defaults, and any other."""
        for arg_name, default in _BASE_DEFAULTS.items():
            if arg_name in kwargs and kwargs.pop(arg_name) != default:
                raise ValueError(
                    f"AccumOptimizer does not support `{arg_name}`. "
                    f"Instead, set `{arg_name}` on the inner optimizer."
                )
        if kwargs:
            raise ValueError(
                f"AccumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`."
            )

    # ------------------------------------------------------------------ state

    def build(self, var_list):
        """Creates the counters, the buffers (`mode="buffer"`) and the inner optimizer's slots."""
        var_list = list(var_list)
        self._begin_build(var_list)
        self.window_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="window_steps"
        )
        with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
            self.window_count = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name="window_count"
            )
        with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
            # One flag per variable: did the window give it a gradient (`accum.modes._window`).
            self.touched = [
                self.add_variable(shape=(), dtype="int64", initializer="zeros", name="touched")
                for _ in (var_list if self._mode.flags_touched else ())
            ]
        self.inner_optimizer.build(var_list)
        self.accumulators = []
        if self._mode.buffered:
            with _distributed.replica_local_variables():
                self.accumulators = [
                    self.add_variable_from_reference(v, name="accumulator") for v in var_list
                ]
        self._mode.check_built(self, self.inner_optimizer, var_list)
        super().build(var_list)
        self._link_batch_norm(var_list)
        self._buffer_window = self._new_buffer_window()
        _warning.warn_for_training_model(self)
        self._guard_recompile()

    def _new_buffer_window(self):
        """`mode="buffer"`'s window (`accum.keras3._buffer_step.BufferWindow`), given what
        it needs of this family: the state, the loss scale, the backend's conditional
        inner update (`_update_when`) and the linked `accum.BatchNormalization` layers."""
        return _buffer_step.BufferWindow(
            self._window_variables(), self._steps_per_update,
            _inner.loss_scale(self.inner_optimizer), self._update_when, self._batch_norm_layers)

    @property
    def variables(self):
        """The wrapper's variables (counters, buffers) followed by the inner optimizer's."""
        return _inner.own_variables(self)[:] + self.inner_optimizer.variables

    def _micro_steps_variable(self):
        return _inner.own_iterations(self)

    def _model_variables_list(self):
        return _inner.own_trainable_variables(self)

    def scale_loss(self, loss):
        """Scales the loss as the inner optimizer does (loss scaling lives there)."""
        return self.inner_optimizer.scale_loss(loss)

    def _has_window_state(self):
        return self.built

    def _pending_micro_steps(self):
        """As `AccumOptimizer`'s; 0 while the counter holds no value: Keras's JAX `fit`
        empties the variables while it runs and finalizes the optimizer in a `finally`,
        so after a step that failed to trace they are still empty there (the error
        raised is the step's, not this one's)."""
        if self.built and self.window_steps._value is None:
            return 0
        return super()._pending_micro_steps()

    # --------------------------------------------------------------- updates

    def apply(self, grads, trainable_variables=None):
        """One micro-step: accumulates `grads`; every `steps_per_update`-th call updates."""
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built on a list of variables. "
                    "Call `optimizer.build(trainable_variables)` first."
                )
            trainable_variables = _inner.own_trainable_variables(self)
            known = None
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
            known = trainable_variables
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        grads = [g for g, _ in pairs]
        indices = _inner.variable_indices(self, [v for _, v in pairs], known)
        if self._steps_per_update == 1 and self._mode.buffered:
            # k=1: every micro-step is an update; the inner optimizer sees the
            # gradients exactly as given (sparse ones stay sparse).
            variables = [_inner.own_trainable_variables(self)[i] for i in indices]
            grads = [_buffer_step.rows_total(g, len(v.shape)) for g, v in zip(grads, variables)]
            self.inner_optimizer.apply(grads, variables)
            _inner.own_iterations(self).assign_add(1)
            self._finish_batch_norm()
            return
        self._micro_step(grads, indices)

    def _micro_step(self, grads, indices):
        """Accumulates `grads` (of the variables `indices`) and ends the window when full:
        `mode="buffer"` in `accum.keras3._buffer_step` (or, in a replica context,
        `accum.modes._distributed`); the other modes by their own micro-step (`accum.modes._modes`)."""
        with keras.name_scope(self.name, caller=self):
            if self._mode.own_micro_step:
                self._mode.micro_step(self, grads, indices)
                return
            if self._accum_strategy is not None and _distributed.in_replica_context():
                self._mode.check_distributable()
                self._distributed_window().micro_step(grads, indices)
                return
            if self._mode.buffered:
                self._buffer_window.micro_step(grads, indices)
                return
            self._mode.accumulate(self, grads, indices)  # "momentum" (TensorFlow)
            _inner.own_iterations(self).assign_add(1)
            _window.maybe_end_window(
                self.steps_per_update, self.window_steps.value, lambda: self._mode.end_window(self)
            )

    def _update_when(self, pred, grads_fn, touched):
        """The inner optimizer's update of every variable with `grads_fn()`, masked by
        `touched`, where the scalar bool `pred` holds (`accum.keras3._buffer_step`): in a
        `tf.cond`, in place."""
        tf.cond(pred, lambda: self._masked_apply(grads_fn, self._buffer_window.state.variables, touched),
                lambda: None)

    def _flush_window(self):
        self._buffer_window.end_window_when(self.window_steps.value > 0)

    # ---------------------------------------------------- tf.distribute path

    def _window_variables(self):
        """The window's state as the wrapper's `keras.Variable`s (`accum.keras3._buffer_step`)."""
        return _window.WindowState(
            micro_steps=_inner.own_iterations(self),
            window_steps=self.window_steps,
            window_count=self.window_count,
            buffers=list(self.accumulators),
            touched=list(self.touched),
            variables=list(_inner.own_trainable_variables(self)),
        )

    def _window_state(self):
        """The window's state as `tf.Variable`s (`accum.modes._window`, `accum.modes._distributed`)."""
        state = self._window_variables()
        return _window.WindowState(*(
            [v.value for v in field] if isinstance(field, list) else field.value for field in state
        ))

    def _loss_scale(self):
        loss_scale = _inner.loss_scale(self.inner_optimizer)
        return None if loss_scale is None else loss_scale[0].value

    def _inner_scope(self):
        """Keras 3 optimizers all-reduce their gradients inside `apply` (TensorFlow
        backend) and have no argument to skip it: the innermost optimizer's all-reduce
        is the identity while the update is traced (`accum.keras3._inner.skip_all_reduce`)."""
        return _inner.skip_all_reduce(self._innermost())

    def _innermost(self):
        """The optimizer that does the update: the inner one, unwrapped from `LossScaleOptimizer`s."""
        innermost = self.inner_optimizer
        while isinstance(innermost, keras.optimizers.LossScaleOptimizer):
            innermost = innermost.inner_optimizer
        return innermost

    def _on_skip(self):
        """What the inner LossScaleOptimizer does with a non-finite step (None without one)."""
        loss_scale = _inner.loss_scale(self.inner_optimizer)
        if loss_scale is None:
            return None
        scale, counter = loss_scale
        counter.assign(0)
        scale.assign(scale * 0.5)

    def _apply_inner(self, grads, indices, touched):
        """The inner optimizer's update of the variables `indices` with `grads`, where
        only those whose `touched` (scalar bool tensors) is true change."""
        variables = [self._buffer_window.state.variables[i] for i in indices]
        self._masked_apply(lambda: grads, variables, touched)

    def _masked_apply(self, grads_fn, variables, touched):
        """The inner `apply` of `grads_fn()` to `variables`, masked by `touched` (its weight
        decay: a select without a strategy, distribution-aware under one)."""
        weight_decay = None if self._accum_strategy is None else _weight_decay
        _buffer_step.masked_apply(
            self.inner_optimizer, self._innermost(), grads_fn, variables, touched, weight_decay)

    def finalize_variable_values(self, var_list):
        """Called at the end of `fit`: warns once about a pending partial window, then
        lets the inner optimizer finalize (EMA overwrite)."""
        self._warn_pending()
        self.inner_optimizer.finalize_variable_values(var_list)

    # --------------------------------------------------------- serialization

    @classmethod
    def _deserialize_inner(cls, config, custom_objects):
        return keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)

    def _serialize_inner(self):
        return keras.saving.serialize_keras_object(self.inner_optimizer)


def _weight_decay(optimizer, variables, touched_of):
    """The weight decay of a masked update under a `tf.distribute` strategy: distribution-aware,
    each variable's decay guarded by its flag (`accum.modes._window.masked_weight_decay`;
    without a strategy, the select `accum.keras3._inner.weight_decay_where`)."""
    _window.masked_weight_decay(optimizer, variables, touched_of, _inner)
