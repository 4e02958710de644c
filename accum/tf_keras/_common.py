"""What the tf_keras implementations (new-style `accum.tf_keras._optimizer`, legacy `accum.tf_keras._legacy`) share.

`TFKerasWindow` is a mixin placed before `AccumOptimizer` and the tf_keras
optimizer class; `TFKerasOps` is what the modes ask of both (their
`accum.modes._family.Family`). A class using them provides: `_INNER_API` (its family's
`accum._inner.InnerApi`), `build`, `_micro_steps_variable()`,
`_config_name()`, `_variable_index(variable)`, `_aggregated(grads_and_vars)`
(the tf_keras all-reduce), `_NO_AGGREGATION` (the keyword argument that keeps the
inner optimizer's `apply_gradients` from all-reducing), `_count_micro_step()`
and `_masked_updates(variables, touched)`; and the attributes
`_built_accum`, `_model_variables`, `accumulators`, `touched`,
`window_steps`, `window_count`.
"""

import tensorflow as tf
import tf_keras

from .._base import AccumOptimizer, WrapperOps
from ..modes import _distributed, _modes, _momentum, _window
from .. import _families
from . import _inner, _inner_legacy, _rescale_step


class TFKerasOps(WrapperOps):
    """What the modes ask of the tf_keras families, new-style and legacy (`accum.modes._family.Family`)."""

    rescale_steps = _rescale_step  # refuses legacy optimizers

    @staticmethod
    def momentum_rule_for(optimizer):
        new, legacy = tf_keras.optimizers, tf_keras.optimizers.legacy
        api = _inner_legacy if isinstance(optimizer, legacy.Optimizer) else _inner
        return _momentum.rule_for(
            optimizer, api, (new.SGD, legacy.SGD), (new.Adam, new.AdamW, legacy.Adam))

    def window_state(self):
        wrapper = self.wrapper
        return _window.WindowState(
            micro_steps=wrapper._micro_steps_variable(),
            window_steps=wrapper.window_steps,
            window_count=wrapper.window_count,
            buffers=wrapper.accumulators,
            touched=wrapper.touched,
            variables=wrapper._model_variables,
        )

    def buffer_window(self):
        return _BUFFER_WINDOW

    def count_micro_step(self):
        return self.wrapper._count_micro_step()

    def on_skip(self):
        """What the inner dynamic `LossScaleOptimizer` does with a non-finite step: halves
        its scale (not below 1) and restarts its count of finite steps (nothing without one)."""
        scale = self.wrapper._INNER_API.loss_scale(self.wrapper.inner_optimizer)
        if scale is not None:
            scale, counter = scale
            counter.assign(0)
            scale.assign(tf.maximum(scale * 0.5, 1.0))

    def apply_inner(self, grads, indices, touched):
        """The inner optimizer's update of the variables `indices`, where only those
        whose `touched` (scalar bool tensors) is true change."""
        wrapper = self.wrapper
        variables = [wrapper._model_variables[i] for i in indices]
        restore = _window.protect_untouched(variables, touched)
        with wrapper._masked_updates(variables, touched):
            wrapper._inner_apply(list(zip(grads, variables)))
        restore()

    def apply_as_given(self, grads, indices):
        """`k=1`: the inner optimizer's `apply_gradients`, not all-reducing the gradients."""
        wrapper = self.wrapper
        wrapper._inner_apply([(g, wrapper._model_variables[i]) for g, i in zip(grads, indices)])


_BUFFER_WINDOW = _window.Window()  # `mode="buffer"` in TensorFlow ops


class TFKerasWindow:
    """The window, delegation and serialization shared by both tf_keras implementations."""

    _OPS = TFKerasOps

    # ------------------------------------------------------------ delegation
    # Legacy `OptimizerV2` keeps hyperparameters in `_hyper`; the wrapper sets
    # none (its `__init__` passes no learning rate), so `learning_rate` and
    # `lr` (which `OptimizerV2.__setattr__` renames to `learning_rate`) reach
    # these properties in both families.

    def _has_window_state(self):
        return self._built_accum

    def _model_variables_list(self):
        return self._model_variables

    @AccumOptimizer.iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    # `lr`: the same property as `learning_rate` (tf_keras LR callbacks use it).
    lr = AccumOptimizer.learning_rate

    def get_scaled_loss(self, loss):
        """The inner `LossScaleOptimizer`'s scaled loss (`loss` if there is none)."""
        scale = getattr(self.inner_optimizer, "get_scaled_loss", None)
        return scale(loss) if scale else loss

    def get_unscaled_gradients(self, grads):
        """The inner `LossScaleOptimizer`'s unscaled gradients (`grads` if there is none)."""
        unscale = getattr(self.inner_optimizer, "get_unscaled_gradients", None)
        return unscale(grads) if unscale else grads

    # --------------------------------------------------------------- updates

    def _micro_step(self, grads_and_vars, name, aggregate):
        """One micro-step on built variables with gradients: all-reduces them if
        `aggregate` (unless accumulated locally), then accumulates; every
        `steps_per_update`-th call updates. Returns the micro-step counter's update."""
        accumulate_locally = self._accumulates_locally()
        if aggregate and not accumulate_locally:
            grads_and_vars = self._aggregated(grads_and_vars)
        if accumulate_locally and not aggregate:
            grads_and_vars = _distributed.local_share(
                grads_and_vars, _inner.wrapped_by_loss_scale_optimizer(self))
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        indices = tuple(self._variable_index(v) for v in variables)
        with tf.name_scope(name or self._config_name()):
            # The selected step (`accum.modes._modes.step_for`): in a replica context each
            # replica accumulates its own gradients, one all-reduce per update
            # (`accum.modes._distributed`). Returns the micro-step counter's update.
            step = self._local_step if accumulate_locally else self._step
            return step.micro_step(self._ops, grads, indices)

    def _accumulates_locally(self):
        """Under a strategy (replica context), gradients are accumulated unreduced (unless
        each micro-step goes to the inner optimizer, `accum.modes._modes.passes_through`)."""
        return _distributed.in_replica_context() and not _modes.passes_through(
            self._mode, self.steps_per_update)

    def _aggregated_unless_local(self, grads_and_vars, aggregate):
        """`aggregate(grads_and_vars)` (the Keras all-reduce), except when the
        gradients are accumulated locally under a strategy: the reduction then
        happens once per update (`accum.modes._distributed`). Both implementations'
        aggregation hooks call this."""
        if self._accumulates_locally():
            return list(grads_and_vars)
        return aggregate(grads_and_vars)

    def _inner_apply(self, grads_and_vars):
        """The inner optimizer's `apply_gradients`, without all-reducing the gradients."""
        self.inner_optimizer.apply_gradients(grads_and_vars, **self._NO_AGGREGATION)

    # --------------------------------------------------------- serialization

    @classmethod
    def _deserialize_inner(cls, config, custom_objects):
        return tf_keras.optimizers.deserialize(
            config,
            custom_objects=custom_objects,
            use_legacy_optimizer=cls._FAMILY == _families.TF_KERAS_LEGACY,
        )

    def _serialize_inner(self):
        return tf_keras.optimizers.serialize(self.inner_optimizer)
