"""`AccumOptimizer` for Keras 3 optimizers on the JAX backend.

The window is the TensorFlow implementation's (`accum._window`): buffers, the
counters `window_steps`/`window_count` and one *touched* flag per variable,
saved and restored the same way. What changes is how state moves. Keras's JAX
trainer is functional: it calls `stateless_apply`, which runs `apply` in a
`keras.StatelessScope` and collects the new values of the variables. So here
every update is an assignment of a value computed from the old ones --
`jnp.where` where TensorFlow branches with `tf.cond` -- except the inner
optimizer's update itself, which runs only on update steps, in a
`jax.lax.cond` whose branch calls the inner optimizer's own `stateless_apply`
on the current values and returns the new ones.

A variable the window did not touch keeps its weights and slots: each
assignment of the inner optimizer's per-variable `update_step` (the
optimizer's `assign`, `assign_add`, `assign_sub`) and its weight decay are
selected by that variable's flag while the update is traced, as the
TensorFlow implementation guards them with `tf.cond`.

`build` is the TensorFlow implementation's (without a strategy its
replica-local scopes are no-ops); `mode="rescale"` is the TensorFlow
backend's too (`accum._rescale_keras3` is written in `keras.ops`). Not on
JAX: `mode="momentum"` and
`tf.distribute` (TensorFlow only).

The counters are int64 variables, which JAX holds as int32 unless
`jax_enable_x64` is on: without it, `steps_per_update` is refused above
`2**31 - 1` (at construction, and again at `build` if x64 was turned off in
between), since `window_steps` reaches `k`.
"""

import contextlib

import keras

from . import _validation, _window
from ._keras3 import Keras3AccumOptimizer


def _jnp():
    import jax.numpy as jnp

    return jnp


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

    # --------------------------------------------------------------- updates

    def _micro_step(self, grads, indices):
        """Adds `grads` to the buffers of `indices` unless one is non-finite; ends a full window.
        (`mode="rescale"`: `accum._rescale_keras3`, in `keras.ops`, as on TensorFlow.)"""
        if self._mode.own_micro_step:
            return super()._micro_step(grads, indices)
        jnp = _jnp()
        scale = self._inner_loss_scale()
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))
        for i, g in zip(indices, grads):
            acc, flag = self.accumulators[i], self.touched[i]
            if scale is not None:
                g = g / scale.value.astype(g.dtype)
            acc.assign(jnp.where(finite, acc.value + g.astype(acc.dtype), acc.value))
            flag.assign(jnp.where(finite, jnp.ones_like(flag.value), flag.value))
        self.window_count.assign(self.window_count.value + finite.astype(self.window_count.value.dtype))
        self.window_steps.assign(self.window_steps.value + 1)
        if scale is not None:  # what the inner LossScaleOptimizer does with a non-finite step
            inner = self.inner_optimizer
            inner.step_counter.assign(jnp.where(finite, inner.step_counter.value, 0))
            scale.assign(jnp.where(finite, scale.value, scale.value * 0.5))
        self._iterations.assign(self._iterations.value + 1)
        self._end_window_when(self.window_steps.value >= self.steps_per_update)

    def _end_window_when(self, full):
        """If `full` (a scalar bool): applies the window's mean (if it kept a micro-batch)
        and starts a new window."""
        import jax

        jnp = _jnp()
        count = self.window_count.value
        scale = self._inner_loss_scale()
        means = []
        for acc in self.accumulators:
            mean = acc.value / jnp.maximum(count, 1).astype(acc.dtype)
            if scale is not None:
                mean = mean * scale.value.astype(acc.dtype)
            means.append(mean)
        touched = [flag.value > 0 for flag in self.touched]
        variables = list(self._trainable_variables)
        inner_variables = list(self.inner_optimizer.variables)

        def update(values, inner_values):
            with self._masked_updates(variables, touched):
                new_values, new_inner = self.inner_optimizer.stateless_apply(inner_values, means, values)
            restore = _protected(variables, touched, values)
            return [restore(i, v) for i, v in enumerate(new_values)], list(new_inner)

        def keep(values, inner_values):
            return list(values), list(inner_values)

        values = [v.value for v in variables]
        inner_values = [v.value for v in inner_variables]
        new_values, new_inner = jax.lax.cond(
            jnp.logical_and(full, count > 0), update, keep, values, inner_values
        )
        for variable, value in zip(variables, new_values):
            variable.assign(value)
        for variable, value in zip(inner_variables, new_inner):
            variable.assign(value)
        for variable in self.accumulators + self.touched + [self.window_steps, self.window_count]:
            variable.assign(jnp.where(full, jnp.zeros_like(variable.value), variable.value))

    @contextlib.contextmanager
    def _masked_updates(self, variables, touched):
        """While the inner update is traced: the per-variable `update_step` and the weight
        decay of the innermost optimizer assign a variable's new values only where its
        touched flag is set (`jnp.where`), so an untouched variable and its slots keep theirs."""
        jnp = _jnp()
        innermost = self._innermost()
        flags = {innermost._var_key(v): t for v, t in zip(variables, touched)}
        update_step = innermost.update_step
        current = []  # the flag of the variable whose update_step runs

        def select(variable, value):
            flag = current[-1] if current else None
            return value if flag is None else jnp.where(flag, value, variable.value)

        def guarded_update_step(gradient, variable, learning_rate):
            current.append(flags.get(innermost._var_key(variable)))
            try:
                update_step(gradient, variable, learning_rate)
            finally:
                current.pop()

        def weight_decay(variables):
            if innermost.weight_decay is None:
                return
            for variable in variables:
                if innermost._use_weight_decay(variable):
                    lr = keras.ops.cast(innermost.learning_rate, variable.dtype)
                    wd = keras.ops.cast(innermost.weight_decay, variable.dtype)
                    new = variable.value - variable.value * wd * lr
                    flag = flags.get(innermost._var_key(variable))
                    variable.assign(new if flag is None else jnp.where(flag, new, variable.value))

        hooks = {
            "update_step": guarded_update_step,
            "_apply_weight_decay": weight_decay,
            "assign": lambda variable, value: variable.assign(select(variable, value)),
            "assign_add": lambda variable, value: variable.assign(
                select(variable, variable.value + value)),
            "assign_sub": lambda variable, value: variable.assign(
                select(variable, variable.value - value)),
        }
        with _window.instance_hooks(innermost, hooks):
            yield

    def flush(self):
        """Applies the pending partial window now, normalized by the micro-batches it holds.

        Does nothing if the window is empty or the optimizer is not built. Eagerly
        (between `fit` calls, in a callback) or inside a traced function that maps
        the optimizer's variables (`stateless_apply`-style). Not with `mode="rescale"`.
        """
        self._check_flushable()
        if not self._has_window_state():
            return
        self._end_window_when(self.window_steps.value > 0)


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
    jnp = _jnp()
    protected = {
        i for i, v in enumerate(variables)
        if getattr(v, "constraint", None) is not None or getattr(v, "overwrite_with_gradient", False)
    }

    def restore(i, value):
        return jnp.where(touched[i], value, old_values[i]) if i in protected else value

    return restore
