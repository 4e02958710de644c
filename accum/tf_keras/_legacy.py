"""`AccumOptimizer` for tf_keras legacy optimizers (`tf_keras.optimizers.legacy.*`, OptimizerV2)."""

import contextlib

import tensorflow as tf
import tf_keras

from .. import _families, _shadow
from .._base import AccumOptimizer, claim_inner
from ..batchnorm import _warning
from ..modes import _distributed, _window
from ._common import TFKerasWindow
from . import _inner_legacy as _api


@tf_keras.saving.register_keras_serializable(package="accum", name="LegacyAccumOptimizer")
class LegacyAccumOptimizer(TFKerasWindow, AccumOptimizer, tf_keras.optimizers.legacy.Optimizer):
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

    _FAMILY = _families.TF_KERAS_LEGACY
    _FAMILY_DESCRIPTION = "tf_keras legacy"
    _INNER_API = _api  # the inner optimizer's private API (`accum._inner`)
    _NO_AGGREGATION = {"experimental_aggregate_gradients": False}

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        steps_per_update, mode, rule = self._checked(optimizer, steps_per_update, mode, kwargs)
        super().__init__(name or "AccumOptimizer")
        self._inner = optimizer
        _api.track(self, optimizer, "inner_optimizer")
        self._init_window(steps_per_update, mode, rule)
        self._built_accum = False
        self._model_variables = []
        self._index = {}
        self._keys = {}  # `_api.var_key` (also of a replica's component) -> index
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
                self._begin_build(new)
            _api.build(self._inner, new)  # slots of new variables only
            if first:
                weight = dict(
                    shape=[], dtype=tf.int64, trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
                self._micro_steps = self.add_weight("micro_steps", **weight)
                self.window_steps = self.add_weight("window_steps", **weight)
                # Replica-local under a strategy (see `accum.modes._distributed`).
                with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                    self.window_count = self.add_weight("window_count", **weight)
            for v in new:
                self._index[v.ref()] = len(self._model_variables)
                self._keys[_api.var_key(self._inner, v)] = len(self._model_variables)
                self._model_variables.append(v)
                # One flag per variable: did the window give it a gradient (`accum.modes._window`).
                # An optimizer weight, not a slot: a scalar slot is revived with its
                # variable's shape by tf_keras's SavedModel `load_model`. Named by
                # position, like the saved buffers (`AccumOptimizer._own_state`).
                with _distributed.replica_local_variables(tf.VariableAggregation.ONLY_FIRST_REPLICA):
                    self.touched.append(self.add_weight(
                        f"touched_{len(self.touched)}", shape=[], dtype=tf.int64, trainable=False,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    ))
                if self._mode.buffered:
                    with _distributed.replica_local_variables():
                        self.accumulators.append(self.add_slot(v, "accumulator"))
        self._mode.check_built(self._ops, self._inner, new)
        self._built_accum = True
        self._select_steps()
        if first:
            _warning.warn_for_training_model(self)
            self._guard_recompile()
        self._link_batch_norm(new)

    def _create_all_weights(self, var_list):
        self.build(var_list)

    def variables(self):
        """The wrapper's counters and buffers, then the inner optimizer's variables."""
        own = [self._micro_steps, self.window_steps, self.window_count] if self._built_accum else []
        return own + list(_api.own_weights(self)) + list(self._inner.variables())

    @property
    def weights(self):
        """Same as `variables()`."""
        return self.variables()

    def _micro_steps_variable(self):
        return self._micro_steps

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return _api.compute_gradients(self._inner, loss, var_list, grad_loss=grad_loss, tape=tape)

    # --------------------------------------------------------------- updates

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """One micro-step: accumulates the gradients; every `steps_per_update`-th call updates."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        self.build([v for _, v in grads_and_vars])
        return self._micro_step(grads_and_vars, name, experimental_aggregate_gradients)

    def _count_micro_step(self):
        return self._micro_steps.assign_add(1)

    def _aggregate_gradients(self, grads_and_vars):
        """All-reduces gradients unless they are accumulated locally (`_aggregated_unless_local`)."""
        return self._aggregated_unless_local(grads_and_vars, super()._aggregate_gradients)

    def _aggregated(self, grads_and_vars):
        return self.gradient_aggregator(grads_and_vars)

    def _variable_index(self, variable):
        if variable.ref() not in self._index:
            raise ValueError(
                f"Unknown variable: {variable.name}. This optimizer can only be called "
                "for the variables it was originally built with."
            )
        return self._index[variable.ref()]

    @contextlib.contextmanager
    def _masked_updates(self, variables, touched):
        """Guards the innermost optimizer's per-variable dense update
        (`_api.UPDATE_STEPS`; the window's means are dense) with the variables'
        touched flags while the update is traced (an instance attribute, removed
        after): an untouched variable and its slots stay as they are."""
        innermost = self._inner
        while getattr(innermost, "inner_optimizer", None) is not None:
            innermost = innermost.inner_optimizer

        def touched_of(var):
            key = _api.var_key(innermost, var)
            return touched[self._keys[key]] if key in self._keys else None

        with _shadow.shadowed(innermost, _window.masked_update_hooks(_api, innermost, touched_of)):
            yield

    def finalize_variable_values(self, var_list):
        """Warns once about a pending partial window (call it at the end of training)."""
        self._warn_pending()

    def _config_name(self):
        return _api.own_name(self)
