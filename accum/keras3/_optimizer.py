"""`AccumOptimizer` for Keras 3 optimizers (TensorFlow backend; `accum.keras3._jax` derives the JAX one)."""

import keras
import tensorflow as tf

from .._base import AccumOptimizer, WrapperOps, claim_inner
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


class Keras3Ops(WrapperOps):
    """What the modes ask of the Keras 3 family (`accum.modes._family.Family`), both backends."""

    rescale_steps = _rescale_step

    @staticmethod
    def momentum_rule_for(optimizer):
        opts = keras.optimizers
        return _momentum.rule_for(optimizer, _inner, (opts.SGD,), (opts.Adam, opts.AdamW))

    def window_variables(self):
        """The window's state as the wrapper's `keras.Variable`s (`accum.keras3._buffer_step`)."""
        wrapper = self.wrapper
        return _window.WindowState(
            micro_steps=_inner.own_iterations(wrapper),
            window_steps=wrapper.window_steps,
            window_count=wrapper.window_count,
            buffers=list(wrapper.accumulators),
            touched=list(wrapper.touched),
            variables=list(_inner.own_trainable_variables(wrapper)),
        )

    def window_state(self):
        """The window's state as `tf.Variable`s (`accum.modes._window`, `accum.modes._distributed`)."""
        state = self.window_variables()
        return _window.WindowState(*(
            [v.value for v in field] if isinstance(field, list) else field.value for field in state
        ))

    def buffer_window(self):
        return self.wrapper._buffer_window

    def count_micro_step(self):
        return _inner.own_iterations(self.wrapper).assign_add(1)

    def loss_scale(self):
        loss_scale = _inner.loss_scale(self.wrapper.inner_optimizer)
        return None if loss_scale is None else loss_scale[0].value

    def inner_scope(self):
        """Keras 3 optimizers all-reduce their gradients inside `apply` (TensorFlow
        backend) and have no argument to skip it: the innermost optimizer's all-reduce
        is the identity while the update is traced (`accum.keras3._inner.skip_all_reduce`)."""
        return _inner.skip_all_reduce(self.wrapper._innermost())

    def on_skip(self):
        """What the inner LossScaleOptimizer does with a non-finite step (None without one)."""
        loss_scale = _inner.loss_scale(self.wrapper.inner_optimizer)
        if loss_scale is None:
            return None
        scale, counter = loss_scale
        counter.assign(0)
        scale.assign(scale * 0.5)

    def apply_inner(self, grads, indices, touched):
        variables = [self.wrapper._buffer_window.state.variables[i] for i in indices]
        self.wrapper._masked_apply(lambda: grads, variables, touched)

    def apply_as_given(self, grads, indices):
        """`k=1`: the inner optimizer's `apply`, the gradients as given (sparse ones stay
        sparse; those stacked per shard summed)."""
        variables = [_inner.own_trainable_variables(self.wrapper)[i] for i in indices]
        grads = [_buffer_step.rows_total(g, len(v.shape)) for g, v in zip(grads, variables)]
        self.wrapper.inner_optimizer.apply(grads, variables)


@keras.saving.register_keras_serializable(package="accum", name="AccumOptimizer")
class Keras3AccumOptimizer(AccumOptimizer, keras.optimizers.Optimizer):
    """`AccumOptimizer` wrapping a Keras 3 optimizer; see `accum.AccumOptimizer`."""

    _FAMILY = _families.KERAS3
    _FAMILY_DESCRIPTION = "Keras 3"
    _OPS = Keras3Ops

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        steps_per_update, mode, rule = self._checked(optimizer, steps_per_update, mode, kwargs)
        super().__init__(learning_rate=0.0, name=name or "accum_optimizer")
        self.inner_optimizer = optimizer
        self._init_window(steps_per_update, mode, rule)
        claim_inner(self, optimizer)

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
        self._mode.check_built(self._ops, self.inner_optimizer, var_list)
        super().build(var_list)
        self._link_batch_norm(var_list)
        self._buffer_window = self._new_buffer_window()
        self._select_steps()
        _warning.warn_for_training_model(self)
        self._guard_recompile()

    def _new_buffer_window(self):
        """`mode="buffer"`'s window (`accum.keras3._buffer_step.BufferWindow`), given what
        it needs of this family: the state, the loss scale, the backend's conditional
        inner update (`_update_when`) and the linked `accum.BatchNormalization` layers."""
        return _buffer_step.BufferWindow(
            self._ops.window_variables(), self._steps_per_update,
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
        self._micro_step(grads, indices)

    def _micro_step(self, grads, indices):
        """The selected step's micro-step (`accum.modes._modes.step_for`): `mode="buffer"`
        in `accum.keras3._buffer_step` (in a replica context, `accum.modes._distributed`;
        `k=1`, the inner optimizer as given), the other modes their own."""
        local = self._accum_strategy is not None and _distributed.in_replica_context()
        with keras.name_scope(self.name, caller=self):
            (self._local_step if local else self._step).micro_step(self._ops, grads, indices)

    def _update_when(self, pred, grads_fn, touched):
        """The inner optimizer's update of every variable with `grads_fn()`, masked by
        `touched`, where the scalar bool `pred` holds (`accum.keras3._buffer_step`): in a
        `tf.cond`, in place."""
        tf.cond(pred, lambda: self._masked_apply(grads_fn, self._buffer_window.state.variables, touched),
                lambda: None)

    def _innermost(self):
        """The optimizer that does the update: the inner one, unwrapped from `LossScaleOptimizer`s."""
        innermost = self.inner_optimizer
        while isinstance(innermost, keras.optimizers.LossScaleOptimizer):
            innermost = innermost.inner_optimizer
        return innermost

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
