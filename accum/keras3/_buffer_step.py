"""`mode="buffer"` for Keras 3, written once in `keras.ops` for the TensorFlow and JAX backends.

`BufferWindow` is the mode's step on Keras 3 (`accum.modes._modes.step_for`, through
`Family.buffer_window()`): `micro_step`, `end_window`, `flush` (`end_window_when`),
over the `accum.modes._window.WindowState` of the wrapper's `keras.Variable`s
(with the semantics `accum.modes._window` describes) and what the family passes in
when it builds the window (`Keras3AccumOptimizer._new_buffer_window`): the loss
scale, the linked `accum.BatchNormalization` layers, and the backend's one
conditional, around the inner optimizer's update, so that only a window's end
that kept a micro-batch computes it: `update_when(pred, grads_fn, touched)`
(TensorFlow: `tf.cond` around the inner `apply`, in place; JAX: `jax.lax.cond`
around its `stateless_apply`, whose state Keras's trainer carries as values).
Every other change of state is a select (`ops.where`), the same ops on both backends.

A variable that the window did not touch keeps its weights and slots: while
the inner update is traced, the innermost optimizer's `assign`, `assign_add`
and `assign_sub` select the old value where the variable's flag is unset, its
weight decay is masked (`masked_updates`; `masked_apply` runs the TensorFlow
update under it), and a variable with a constraint gets its old value back.

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


class BufferWindow:
    """`mode="buffer"` on Keras 3, both backends: a step (`micro_step`, `end_window`,
    `flush`, all by `end_window_when`) over the window's state and what the family
    passes in when the wrapper is built (nothing is asked of the family afterwards: the
    steps' `family` argument, its `Family`, is not read).

    `state`: the `accum.modes._window.WindowState` of the wrapper's `keras.Variable`s;
    `loss_scale`: the inner `LossScaleOptimizer`'s `(scale, counter)` variables, or None;
    `update_when(pred, grads_fn, touched)`: the backend's inner update of every variable
    with `grads_fn()`, masked by `touched`, where the scalar bool `pred` holds (TensorFlow:
    `tf.cond` around the inner `apply`; JAX: `jax.lax.cond` around its `stateless_apply`);
    `batch_norm_layers`: the linked `accum.BatchNormalization` layers (a list the wrapper
    extends in place when it links more).
    """

    def __init__(self, state, steps_per_update, loss_scale, update_when, batch_norm_layers):
        self.state = state
        self.steps_per_update = steps_per_update
        self.scale, self.counter = loss_scale or (None, None)
        self.update_when = update_when
        self.batch_norm_layers = batch_norm_layers

    def micro_step(self, family, grads, indices):
        """Adds `grads` (of the variables `indices`) to their buffers and sets their touched
        flags unless one is non-finite (then the inner `LossScaleOptimizer`, if any, halves
        its scale), counts the micro-step, and ends the window when it is full."""
        state, scale, counter = self.state, self.scale, self.counter
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
        self.end_window_when(state.window_steps.value >= self.steps_per_update)

    def end_window(self, family):
        self.end_window_when(True)

    def flush(self, family):
        """Ends the window now if it holds a micro-step."""
        self.end_window_when(self.state.window_steps.value > 0)

    def end_window_when(self, full):
        """If `full` (a scalar bool): applies the window's mean to the variables it touched
        (if it kept a micro-batch) and starts a new window; the linked
        `accum.BatchNormalization` layers end theirs."""
        state, scale = self.state, self.scale
        count = state.window_count.value

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
        self.update_when(ops.logical_and(full, count > 0), means, touched)
        for variable in [*state.buffers, *state.touched, state.window_steps, state.window_count]:
            variable.assign(ops.where(full, ops.zeros_like(variable.value), variable.value))
        for layer in self.batch_norm_layers:
            layer.finish_window(full)


def masked_apply(optimizer, innermost, grads_fn, variables, touched, weight_decay=None):
    """`optimizer.apply(grads_fn(), variables)` (TensorFlow backend: in place), its writes
    masked by `touched` (`masked_updates`)."""
    grads = grads_fn()
    with masked_updates(innermost, variables, touched, weight_decay):
        optimizer.apply(grads, variables)


@contextlib.contextmanager
def masked_updates(innermost, variables, touched, weight_decay=None, protect=True):
    """While the inner update is traced: the innermost optimizer's per-variable
    `update_step` writes a variable's new values (its own and its slots', through the
    optimizer's `assign`, `assign_add`, `assign_sub`) only where that variable's flag in
    `touched` (scalar bool tensors, one per variable) is set; its `_apply_weight_decay`
    is `weight_decay(innermost, variables, touched_of)` (None: Keras 3's, as a select,
    `accum.keras3._inner.weight_decay_where`). Instance attributes, removed afterwards
    (`accum._shadow.shadowed`). `protect`: on exit, a variable with a constraint (or
    `overwrite_with_gradient`), which the inner optimizer changes outside `update_step`,
    gets back its old value where the window left it untouched (in place; the JAX
    update, which returns new values, keeps them itself)."""
    api = _inner
    flags = dict(zip(api.var_keys(innermost, variables), touched))
    by_id = {}  # the same variables, most often: found without a key
    for v, t in zip(variables, touched):
        by_id[id(v)] = t
        if isinstance(getattr(v, "value", None), tf.Variable):  # what TensorFlow's update_step gets
            by_id[id(v.value)] = t
    (update_name,) = api.UPDATE_STEPS
    update_step = getattr(innermost, update_name)
    assign = innermost.assign
    current = []  # the flag of the variable whose update_step runs

    def touched_of(variable):
        if id(variable) in by_id:
            return by_id[id(variable)]
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

    def decay(vs):
        if weight_decay is not None:
            return weight_decay(innermost, vs, touched_of)
        return api.weight_decay_where(innermost, vs, [touched_of(v) for v in vs])

    hooks = {
        update_name: guarded_update_step,
        api.WEIGHT_DECAY: decay,
        "assign": lambda variable, value: assign(variable, selected(variable, value)),
        "assign_add": lambda variable, value: assign(
            variable, selected(variable, ops.convert_to_tensor(variable) + _dense(value))),
        "assign_sub": lambda variable, value: assign(
            variable, selected(variable, ops.convert_to_tensor(variable) - _dense(value))),
    }
    saved = [
        (v, t, ops.copy(ops.convert_to_tensor(v))) for v, t in zip(variables, touched)
        if protect and _changed_outside_update_step(v)
    ]
    with _shadow.shadowed(innermost, hooks):
        yield
    for variable, flag, old in saved:
        variable.assign(ops.where(flag, ops.convert_to_tensor(variable), old))


def _changed_outside_update_step(variable):
    """Whether the inner optimizer changes `variable` outside `update_step` (a constraint,
    Keras 3's `overwrite_with_gradient`)."""
    return getattr(variable, "constraint", None) is not None or getattr(
        variable, "overwrite_with_gradient", False)


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
