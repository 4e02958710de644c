"""`AccumOptimizer` for tf_keras legacy optimizers (`tf_keras.optimizers.legacy.*`, OptimizerV2)."""

import contextlib

import tensorflow as tf
import tf_keras
from tf_keras.src.optimizers.legacy.optimizer_v2 import _var_key

from . import _backends, _batchnorm, _distributed, _validation, _window
from ._base import AccumOptimizer, check_optimizer, claim_inner
from ._tf_keras import inner_loss_scale_state, warn_pending


@tf_keras.saving.register_keras_serializable(package="accum", name="LegacyAccumOptimizer")
class LegacyAccumOptimizer(AccumOptimizer, tf_keras.optimizers.legacy.Optimizer):
    """`AccumOptimizer` wrapping a tf_keras legacy optimizer; see `accum.AccumOptimizer`.

    Counters and touched flags are optimizer weights and buffers are slots
    (`get_slot(var, "accumulator")`), so checkpoints restore them by name and
    by variable. Like the plain legacy
    optimizers, it accepts variables it has not seen yet (e.g. layers
    unfrozen after some training): their buffers and the inner optimizer's
    slots are created then.
    tf_keras's `fit` does not finalize legacy optimizers, so the pending-window
    warning at the end of `fit` is not issued: use `flush_callback()`.
    """

    _FAMILY = _backends.TF_KERAS_LEGACY

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        if check_optimizer(optimizer) != self._FAMILY:
            raise ValueError(
                "This `AccumOptimizer` class wraps tf_keras legacy optimizers; build it "
                "with `accum.AccumOptimizer(optimizer, steps_per_update)`. "
                f"Received: optimizer={optimizer!r}"
            )
        steps_per_update = _validation.check_steps_per_update(steps_per_update)
        mode = _validation.check_mode(mode)
        if kwargs:
            raise ValueError(
                f"AccumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. "
                "Set them on the inner optimizer."
            )
        rule = None
        if mode == "momentum":
            from ._momentum_tf_keras import rule_for

            rule = rule_for(optimizer)
        super().__init__(name or "AccumOptimizer")
        self._inner = optimizer
        self._track_trackable(optimizer, name="inner_optimizer")
        self._steps_per_update = steps_per_update
        self.mode = mode
        self._rule = rule
        self._warned_pending = False
        self._built_accum = False
        self._model_variables = []
        self._index = {}
        self._keys = {}  # `_var_key` (also of a replica's component) -> index
        self.accumulators = []
        self.touched = []
        claim_inner(self, optimizer)

    @property
    def inner_optimizer(self):
        """The wrapped optimizer."""
        return self._inner

    # ------------------------------------------------------------------ state

    def build(self, var_list):
        """Creates counters, buffers (`mode="buffer"`) and the inner optimizer's slots;
        called again with new variables, creates theirs (as OptimizerV2 does)."""
        new = []
        for v in var_list:
            if v.ref() not in self._index and all(v is not n for n in new):
                new.append(v)
        if self._built_accum and not new:
            return
        first = not self._built_accum
        with tf.init_scope():
            if first:
                self._accum_strategy = _distributed.current_strategy()
                if self._accum_strategy is not None and self.mode != "buffer":
                    raise _distributed.momentum_not_supported()
            # OptimizerV2 has no public `build`; this is what its
            # `apply_gradients` calls first (slots of new variables only).
            self._inner._create_all_weights(new)
            if first:
                weight = dict(
                    shape=[], dtype=tf.int64, trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
                self._micro_steps = self.add_weight("micro_steps", **weight)
                self.window_steps = self.add_weight("window_steps", **weight)
                # Replica-local under a strategy (see `accum._distributed`).
                with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                    self.window_count = self.add_weight("window_count", **weight)
            for v in new:
                self._index[v.ref()] = len(self._model_variables)
                self._keys[_var_key(v)] = len(self._model_variables)
                self._model_variables.append(v)
                # One flag per variable: did the window give it a gradient (`accum._window`).
                # An optimizer weight, not a slot: a scalar slot is revived with its
                # variable's shape by tf_keras's SavedModel `load_model`. Named by
                # position, like the saved buffers (`AccumOptimizer._own_state`).
                with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                    self.touched.append(self.add_weight(
                        f"touched_{len(self.touched)}", shape=[], dtype=tf.int64, trainable=False,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    ))
                if self.mode == "buffer":
                    with _distributed.replica_local_variables():
                        self.accumulators.append(self.add_slot(v, "accumulator"))
        if self.mode == "momentum":
            self._rule.check_built(self._inner, new)
        self._built_accum = True
        if first:
            _batchnorm.warn_for_training_model(self)

    def _create_all_weights(self, var_list):
        self.build(var_list)

    def variables(self):
        """The wrapper's counters and buffers, then the inner optimizer's variables."""
        own = [self._micro_steps, self.window_steps, self.window_count] if self._built_accum else []
        return own + list(self._weights) + list(self._inner.variables())

    @property
    def weights(self):
        """Same as `variables()`."""
        return self.variables()

    def _has_window_state(self):
        return self._built_accum

    def _model_variables_list(self):
        return self._model_variables

    def _micro_steps_variable(self):
        return self._micro_steps

    @property
    def iterations(self):
        """Applied updates: the inner optimizer's `iterations`."""
        return self._inner.iterations

    @iterations.setter
    def iterations(self, variable):
        self._inner.iterations = variable

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (settable, for LR callbacks)."""
        return self._inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self._inner.learning_rate = learning_rate

    @property
    def lr(self):
        """Alias of `learning_rate`."""
        return self._inner.learning_rate

    @lr.setter
    def lr(self, learning_rate):
        self._inner.learning_rate = learning_rate

    def get_scaled_loss(self, loss):
        """The inner `LossScaleOptimizer`'s scaled loss (`loss` if there is none)."""
        scale = getattr(self._inner, "get_scaled_loss", None)
        return scale(loss) if scale else loss

    def get_unscaled_gradients(self, grads):
        """The inner `LossScaleOptimizer`'s unscaled gradients (`grads` if there is none)."""
        unscale = getattr(self._inner, "get_unscaled_gradients", None)
        return unscale(grads) if unscale else grads

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return self._inner._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)

    # --------------------------------------------------------------- updates

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """One micro-step: accumulates the gradients; every `steps_per_update`-th call updates."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        self.build([v for _, v in grads_and_vars])
        accumulate_locally = self._accumulates_locally()
        if experimental_aggregate_gradients and not accumulate_locally:
            grads_and_vars = self.gradient_aggregator(grads_and_vars)
        if accumulate_locally and not experimental_aggregate_gradients:
            grads_and_vars = _distributed.local_share(self, grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        indices = tuple(self._variable_index(v) for v in variables)
        with tf.name_scope(name or self._name):
            if accumulate_locally:
                # Each replica accumulates its own gradients; one all-reduce per
                # update (`accum._distributed`).
                if self.mode != "buffer":
                    raise _distributed.momentum_not_supported()
                return self._distributed_window().micro_step(grads, indices)
            if self.steps_per_update == 1 and self.mode == "buffer":
                self._inner.apply_gradients(
                    list(zip(grads, variables)), experimental_aggregate_gradients=False
                )
            else:
                if self.mode == "buffer":
                    self._accumulate(grads, indices)
                else:
                    self._rule.accumulate(self, grads, indices)
                _window.maybe_end_window(
                    self.steps_per_update, self.window_steps, self._end_window
                )
            return self._micro_steps.assign_add(1)

    def _accumulates_locally(self):
        """Under a strategy (replica context), gradients are accumulated unreduced."""
        return _distributed.in_replica_context() and not (
            self.steps_per_update == 1 and self.mode == "buffer"
        )

    def _aggregate_gradients(self, grads_and_vars):
        """All-reduces gradients, except when they are accumulated locally under a strategy
        (the reduction then happens once per update: `accum._distributed`)."""
        if self._accumulates_locally():
            return list(grads_and_vars)
        return super()._aggregate_gradients(grads_and_vars)

    def _variable_index(self, variable):
        if variable.ref() not in self._index:
            raise ValueError(
                f"Unknown variable: {variable.name}. This optimizer can only be called "
                "for the variables it was originally built with."
            )
        return self._index[variable.ref()]

    def _accumulate(self, grads, indices):
        state = inner_loss_scale_state(self._inner)

        def on_skip():
            state.counter.assign(0)
            state.current_loss_scale.assign(tf.maximum(state.current_loss_scale * 0.5, 1.0))

        _window.accumulate(
            [self.accumulators[i] for i in indices], grads, self.window_steps, self.window_count,
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
        with self._masked_updates(touched):
            self._inner.apply_gradients(
                list(zip(grads, variables)), experimental_aggregate_gradients=False
            )
        restore()

    @contextlib.contextmanager
    def _masked_updates(self, touched):
        """Guards the innermost optimizer's per-variable dense update
        (`_resource_apply_dense`; the window's means are dense) with the variables'
        touched flags while the update is traced (an instance attribute, removed
        after): an untouched variable and its slots stay as they are."""
        innermost = self._inner
        while getattr(innermost, "inner_optimizer", None) is not None:
            innermost = innermost.inner_optimizer
        apply_dense = innermost._resource_apply_dense

        def guarded_apply_dense(grad, var, **kwargs):
            flag = touched[self._keys[_var_key(var)]] if _var_key(var) in self._keys else None
            return _window.guarded(flag, lambda: apply_dense(grad, var, **kwargs))

        with _window.instance_hooks(innermost, {"_resource_apply_dense": guarded_apply_dense}):
            yield

    def _distributed_window(self):
        """The `accum._distributed.Window` of this optimizer (see there)."""
        state = inner_loss_scale_state(self._inner)

        def on_skip():
            state.counter.assign(0)
            state.current_loss_scale.assign(tf.maximum(state.current_loss_scale * 0.5, 1.0))

        return _distributed.Window(
            self,
            buffers=lambda indices: [self.accumulators[i] for i in indices],
            all_buffers=lambda: self.accumulators,
            destinations=lambda indices: [self._model_variables[i] for i in indices],
            window_steps=lambda: self.window_steps,
            window_count=lambda: self.window_count,
            micro_steps=lambda: self._micro_steps,
            apply_inner=self._apply_mean_gradients,
            on_skip=None if state is None else on_skip,
            touched=lambda indices: [self.touched[i] for i in indices],
        )

    def flush(self):
        """Applies the pending partial window now, normalized by the micro-batches it holds.

        Does nothing if the window is empty or the optimizer is not built.
        """
        if not self._built_accum:
            return
        if getattr(self, "_accum_strategy", None) is not None:
            indices = tuple(range(len(self._model_variables)))
            self._distributed_window().flush(self._accum_strategy, indices)
            return
        _window.flush(self.window_steps, self._end_window)

    def finalize_variable_values(self, var_list):
        """Warns once about a pending partial window (call it at the end of training)."""
        warn_pending(self)

    # --------------------------------------------------------- serialization

    @classmethod
    def _deserialize_inner(cls, config, custom_objects):
        return tf_keras.optimizers.deserialize(
            config, custom_objects=custom_objects, use_legacy_optimizer=True
        )

    def _serialize_inner(self):
        return tf_keras.optimizers.serialize(self._inner)

    def _config_name(self):
        return self._name
