"""`AccumOptimizer` for Keras 3 optimizers on the JAX backend.

The window and `mode="buffer"` are the TensorFlow backend's, written once in
`keras.ops` (`accum.keras3._buffer_step`): the same variables, saved and restored the
same way, every change a select. What is JAX's own is how the inner update
runs. Keras's JAX trainer is functional: it calls `stateless_apply`, which
runs `apply` in a `keras.StatelessScope` and collects the new values of the
variables. So the inner optimizer's update runs only on update steps, in a
`jax.lax.cond` whose branch calls the inner optimizer's own `stateless_apply`
on the current values and returns the new ones (`_update_when`), and the
weight decay of an untouched variable is masked by a select
(`accum.keras3._inner.weight_decay_where`, as on TensorFlow without a strategy).

`build` is the TensorFlow implementation's (without a strategy its
replica-local scopes are no-ops); `mode="rescale"` is the TensorFlow
backend's too (`accum.keras3._rescale_step` is written in `keras.ops`). Not on
JAX: `mode="momentum"` and
`tf.distribute` (TensorFlow only).

The counters are int64 variables, which JAX holds as int32 unless
`jax_enable_x64` is on: without it, `steps_per_update` is refused above
`2**31 - 1` (at construction, and again at `build` if x64 was turned off in
between), since `window_steps` reaches `k`.
"""

import keras

from .. import _validation
from ._optimizer import Keras3AccumOptimizer
from . import _buffer_step, _inner


@keras.saving.register_keras_serializable(package="accum", name="AccumOptimizer")
class JaxAccumOptimizer(Keras3AccumOptimizer):
    """`AccumOptimizer` wrapping a Keras 3 optimizer on the JAX backend; see `accum.AccumOptimizer`."""

    def __init__(self, optimizer, steps_per_update, mode="buffer", name=None, **kwargs):
        if mode == "momentum":
            raise NotImplementedError(
                '`mode="momentum"` runs on the TensorFlow backend only (its update '
                "branches on TensorFlow variables). On the JAX backend use "
                '`mode="buffer"` (the default) or `mode="rescale"`. Received: mode="momentum" on the '
                "'jax' backend"
            )
        super().__init__(optimizer, steps_per_update, mode=mode, name=name, **kwargs)

    def _check_arguments(self, steps_per_update, mode):
        steps_per_update, mode = super()._check_arguments(steps_per_update, mode)
        _check_counter_range(steps_per_update)
        return steps_per_update, mode

    def build(self, var_list):
        """Checks that the counters can hold `steps_per_update`, then builds (see `Keras3AccumOptimizer`)."""
        _check_counter_range(self.steps_per_update)
        super().build(var_list)

    # ------------------------------------------- one row per device (`local_gradients`)

    def _use_device_rows(self, mesh, axis, shards):
        """Gives each buffer one row per shard of the batch axis (`accum.keras3._local_jax`),
        the current buffer in row 0; True if the buffers changed."""
        from . import _local_jax

        rows = _local_jax.DeviceRows(mesh, axis, shards)
        if getattr(self, "_device_rows", None) is not None and (
                self._device_rows.shards, self._device_rows.axis) == (shards, axis):
            return False
        saved = [b.numpy() for b in self._checkpoint_buffers()]
        with keras.name_scope(self.name, caller=self):
            new = [rows.buffer_for(v, "accumulator") for v in _inner.own_trainable_variables(self)]
        for old, buffer, value in zip(self.accumulators, new, saved):
            own = _inner.own_variables(self)
            own[next(i for i, v in enumerate(own) if v is old)] = buffer
            _local_jax.SavedRows(buffer).assign(value)
        # Not through Keras's tracker, which would add them to the variables a second time.
        object.__setattr__(self, "accumulators", new)
        self._device_rows = rows
        self._buffer_window = self._new_buffer_window()
        self._select_steps()
        return True

    def _checkpoint_buffers(self):
        """The buffers, those with one row per device as their rows' sum (`accum.keras3._local_jax`)."""
        if getattr(self, "_device_rows", None) is None:
            return self.accumulators
        from . import _local_jax

        return [_local_jax.SavedRows(b) for b in self.accumulators]

    # --------------------------------------------------------------- updates
    # The micro-step and the window's end are `accum.keras3._buffer_step`'s, as on TensorFlow.

    def _update_when(self, pred, grads_fn, touched):
        """The inner optimizer's update of every variable with `grads_fn()`, masked by
        `touched`, where the scalar bool `pred` holds (`accum.keras3._buffer_step`): in a
        `jax.lax.cond` whose update branch runs the inner optimizer's `stateless_apply`
        on the current values; the new values are assigned."""
        import jax

        variables = list(self._buffer_window.state.variables)
        inner_variables = list(self.inner_optimizer.variables)

        def update(values, inner_values):
            with _buffer_step.masked_updates(self._innermost(), variables, touched, protect=False):
                new_values, new_inner = self.inner_optimizer.stateless_apply(
                    inner_values, grads_fn(), values)
            restore = _protected(variables, touched, values)
            return [restore(i, v) for i, v in enumerate(new_values)], list(new_inner)

        def keep(values, inner_values):
            return list(values), list(inner_values)

        new_values, new_inner = jax.lax.cond(
            pred, update, keep, [v.value for v in variables], [v.value for v in inner_variables]
        )
        for variable, value in zip(variables + inner_variables, new_values + new_inner):
            variable.assign(value)


def _check_counter_range(steps_per_update):
    """A Keras-style `ValueError` if int64 counters hold int32 (`jax_enable_x64` off)
    and `steps_per_update` does not fit."""
    import jax
    import numpy as np

    if steps_per_update <= _validation.MAX_STEPS_PER_UPDATE_INT32:
        return
    if jax.dtypes.canonicalize_dtype(np.int64) == np.int64:
        return
    raise ValueError(
        "`steps_per_update` must be an integer >= 1 and <= 2**31 - 1 on the JAX backend "
        "without 64-bit integers: the window counters are int64 variables, which JAX holds "
        "as int32 while `jax_enable_x64` is off. Turn it on before Keras creates variables "
        '(`jax.config.update("jax_enable_x64", True)` or JAX_ENABLE_X64=1) for up to '
        f"2**63 - 1. Received: steps_per_update={steps_per_update!r}"
    )


def _protected(variables, touched, old_values):
    """For variables with a constraint or `overwrite_with_gradient`, which the inner optimizer
    changes outside `update_step`: a function (index, new value) -> the value to keep, the old
    one where the window left the variable untouched."""
    protected = {
        i for i, v in enumerate(variables)
        if getattr(v, "constraint", None) is not None or getattr(v, "overwrite_with_gradient", False)
    }

    def restore(i, value):
        return keras.ops.where(touched[i], value, old_values[i]) if i in protected else value

    return restore
