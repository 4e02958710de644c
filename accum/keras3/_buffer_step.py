"""`mode="buffer"` for Keras 3, written once in `keras.ops` for the TensorFlow and JAX backends.

The window is the `accum.modes._window.WindowState` of the wrapper's `keras.Variable`s
(`Keras3AccumOptimizer._window_variables`), with the semantics `accum.modes._window`
describes. Every change of state is a select (`ops.where`), the same ops on
both backends; one conditional is left, around the inner optimizer's update,
so that only a window's end that kept a micro-batch computes it: the family's
`_update_when(pred, grads_fn, touched)` (TensorFlow: `tf.cond` around the
inner `apply`, in place; JAX: `jax.lax.cond` around its `stateless_apply`,
whose state Keras's trainer carries as values).

A variable that the window did not touch keeps its weights and slots: while
the inner update is traced, the innermost optimizer's `assign`, `assign_add`
and `assign_sub` select the old value where the variable's flag is unset
(`masked_updates`), and its weight decay is the family's masked one.

TensorFlow-only, where TensorFlow is the point: a sparse gradient
(`tf.IndexedSlices`) is scatter-added into its buffer (`accum.modes._window.add_to`,
in a `tf.cond`) so it never becomes a dense tensor, and under `tf.distribute`
the window is `accum.modes._distributed`'s.

A buffer may hold one row per shard of the batch (`accum.local_gradients` on
JAX, `accum.keras3._local_jax`): a micro-step's gradients stacked per shard are added
row by row, and the window's mean is of the rows' sum (`add_to_rows`,
`rows_total`; a buffer without rows is the same code with equal ranks).
"""

import contextlib

import tensorflow as tf
from keras import ops

from .. import _shadow
from ..modes import _window
from . import _inner


def micro_step(wrapper, grads, indices):
    """One micro-step: adds `grads` (of the variables `indices`) to their buffers and sets
    their touched flags unless one is non-finite (then the inner `LossScaleOptimizer`, if
    any, halves its scale), counts the micro-step, and ends the window when it is full."""
    state = wrapper._window_variables()
    scale, counter = _inner.loss_scale(wrapper.inner_optimizer) or (None, None)
    finite = _all_finite(grads)
    for i, g in zip(indices, grads):
        if scale is not None:
            g = _unscaled(g, scale)
        _add(state.buffers[i], g, finite)
        flag = state.touched[i]
        flag.assign(ops.where(finite, ops.ones_like(flag.value), flag.value))
    count = state.window_count
    count.assign(count.value + ops.cast(finite, count.dtype))
    state.window_steps.assign(state.window_steps.value + 1)
    if scale is not None:  # what the inner LossScaleOptimizer does with a non-finite step
        counter.assign(ops.where(finite, counter.value, ops.zeros_like(counter.value)))
        scale.assign(ops.where(finite, scale.value, scale.value * 0.5))
    state.micro_steps.assign(state.micro_steps.value + 1)
    end_window_when(wrapper, state.window_steps.value >= wrapper.steps_per_update)


def end_window_when(wrapper, full):
    """If `full` (a scalar bool): applies the window's mean to the variables it touched (if
    it kept a micro-batch) and starts a new window; the linked `accum.BatchNormalization`
    layers end theirs."""
    state = wrapper._window_variables()
    count = state.window_count.value
    scale, _ = _inner.loss_scale(wrapper.inner_optimizer) or (None, None)

    def means():
        result = []
        for buffer, variable in zip(state.buffers, state.variables):
            total = rows_total(buffer.value, len(variable.shape))
            mean = total / ops.cast(ops.maximum(count, 1), buffer.dtype)
            if scale is not None:
                mean = mean * ops.cast(scale.value, buffer.dtype)
            result.append(mean)
        return result

    touched = [flag.value > 0 for flag in state.touched]
    wrapper._update_when(ops.logical_and(full, count > 0), means, touched)
    for variable in [*state.buffers, *state.touched, state.window_steps, state.window_count]:
        variable.assign(ops.where(full, ops.zeros_like(variable.value), variable.value))
    wrapper._finish_batch_norm(full)


@contextlib.contextmanager
def masked_updates(innermost, variables, touched, weight_decay):
    """While the inner update is traced: the innermost optimizer's per-variable
    `update_step` writes a variable's new values (its own and its slots', through the
    optimizer's `assign`, `assign_add`, `assign_sub`) only where that variable's flag in
    `touched` (scalar bool tensors, one per variable) is set; its `_apply_weight_decay`
    is `weight_decay(innermost, variables, touched_of)` (the family's masked one).
    Instance attributes, removed afterwards (`accum._shadow.shadowed`)."""
    api = _inner
    flags = {api.var_key(innermost, v): t for v, t in zip(variables, touched)}
    (update_name,) = api.UPDATE_STEPS
    update_step = getattr(innermost, update_name)
    assign = innermost.assign
    current = []  # the flag of the variable whose update_step runs

    def touched_of(variable):
        return flags.get(api.var_key(innermost, variable))

    def guarded_update_step(gradient, variable, learning_rate):
        current.append(touched_of(variable))
        try:
            update_step(gradient, variable, learning_rate)
        finally:
            current.pop()

    def selected(variable, value):
        old = ops.convert_to_tensor(variable)
        flag = current[-1] if current else None
        return value if flag is None else ops.where(flag, ops.cast(value, old.dtype), old)

    hooks = {
        update_name: guarded_update_step,
        api.WEIGHT_DECAY: lambda vs: weight_decay(innermost, vs, touched_of),
        "assign": lambda variable, value: assign(variable, selected(variable, value)),
        "assign_add": lambda variable, value: assign(
            variable, selected(variable, ops.convert_to_tensor(variable) + _dense(value))),
        "assign_sub": lambda variable, value: assign(
            variable, selected(variable, ops.convert_to_tensor(variable) - _dense(value))),
    }
    with _shadow.shadowed(innermost, hooks):
        yield


def rows_total(value, weight_rank):
    """A buffer's value as one device would hold it: its rows summed when it has them."""
    if len(value.shape) == weight_rank + 1:
        return ops.sum(value, axis=0)
    return value


def add_to_rows(buffer_value, g):
    """`buffer_value + g` for a buffer with rows: `g` stacked per shard is added row by
    row; a reduced `g` (the weight's shape) goes to row 0."""
    if len(g.shape) == len(buffer_value.shape):
        return buffer_value + g
    row = ops.arange(buffer_value.shape[0])
    first = ops.reshape(row == 0, (-1,) + (1,) * len(g.shape))
    return buffer_value + ops.where(first, g[None], ops.zeros_like(g)[None])


def _all_finite(grads):
    return ops.all(ops.stack([ops.all(ops.isfinite(_values(g))) for g in grads]))


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _unscaled(g, scale):
    """`g / scale` (a dense tensor or `IndexedSlices`, which stay sparse)."""
    if isinstance(g, tf.IndexedSlices):
        return _window.scale_gradient(g, 1.0 / tf.cast(scale.value, tf.float64))
    return g / ops.cast(scale.value, g.dtype)


def _add(buffer, g, finite):
    """`buffer += g` where `finite`; a sparse gradient is scatter-added (TensorFlow)."""
    if isinstance(g, tf.IndexedSlices):
        tf.cond(finite, lambda: _window.add_to(buffer.value, g), lambda: None)
        return
    total = add_to_rows(buffer.value, ops.cast(g, buffer.dtype))
    buffer.assign(ops.where(finite, total, buffer.value))


def _dense(value):
    """The optimizers' `assign_add(variable, value)` of a masked update, as a dense tensor
    (the window's means are dense; the select needs the whole new value)."""
    return tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value
