"""The accumulation window (`mode="buffer"`): its state, and its TensorFlow ops.

A window is `steps_per_update` micro-steps. Each micro-step adds its gradients
to one buffer per variable (`IndexedSlices` by scatter-add, so a sparse
gradient never becomes a full-size dense tensor) unless they are non-finite,
and counts itself in `window_steps` and, if kept, in `window_count`. The
last micro-step of a window calls `apply_fn` with `buffer / window_count`
(only if some micro-batch was kept), then zeroes the buffers and counters.

A variable missing from a micro-step (absent from `grads_and_vars`, or with a
`None` gradient) contributes a zero gradient to that micro-step, as if the
loss did not depend on it: the update applies the window's mean to every
variable that got a gradient in some kept micro-step of the window. Each
variable has a *touched* flag (a scalar variable, set when a kept micro-step
holds a gradient for it); a variable untouched by the whole window is left
alone, as the inner optimizer at batch `k * b` leaves a variable with no
gradient (its weights and slots do not move: Adam's moments do not decay).
The inner optimizer is applied to every variable, with its per-variable
updates guarded by the flags (`masked_updates` in each family), so the set of
variables updated is decided at run time, from state that can span several
traced functions (a multi-task loop alternating heads).

Branching is `tf.cond` on variables, never Python `if` on values, so the same
code runs eagerly, in `tf.function` and under XLA (`jit_compile=True`), and
only the branch taken runs.

The ops here serve tf_keras, and Keras 3 under `tf.distribute`
(`accum.modes._distributed`); Keras 3 otherwise runs the same window in `keras.ops`
on TensorFlow and JAX (`accum.keras3._buffer_step`, selects instead of branches).
All variables passed here are `tf.Variable`s (Keras 3 passes
`keras.Variable.value`). The window's state is one record, `WindowState`, that
each family builds from its variables (`accum.modes._family.Family.window_state`) and
every mode and the distributed path (`accum.modes._distributed`) read. `Window` is
the mode's step in these ops (tf_keras's `Family.buffer_window()`).
"""

from typing import NamedTuple, Sequence

import tensorflow as tf


class WindowState(NamedTuple):
    """The state of the accumulation window, as the wrapper's `tf.Variable`s (Keras 3
    backends give `keras.Variable.value`), in the spirit of optax's `MultiStepsState`.
    Saved with the optimizer (`AccumOptimizer._own_state`); under a strategy,
    `window_count`, `buffers` and `touched` are replica-local (`accum.modes._distributed`)."""

    micro_steps: tf.Variable  # int64: every micro-step so far (`AccumOptimizer.micro_steps`)
    window_steps: tf.Variable  # int64: micro-steps in the current window, 0..k
    window_count: tf.Variable  # int64: micro-batches the window kept (all finite)
    buffers: Sequence[tf.Variable]  # per model variable, the window's gradient sum (mode="buffer")
    touched: Sequence[tf.Variable]  # per model variable, 0/1: the window gave it a gradient
    variables: Sequence[tf.Variable]  # the model variables, in the optimizer's order


def all_finite(grads):
    """A scalar bool tensor: every gradient (dense or `IndexedSlices`) is finite."""
    checks = []
    for g in grads:
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    return tf.reduce_all(tf.stack(checks))


def scale_gradient(g, factor):
    """`g * factor` for a dense or `IndexedSlices` gradient (stays sparse)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def add_to(buffer, g):
    """Adds gradient `g` into `buffer` in place; `IndexedSlices` are scatter-added."""
    if isinstance(g, tf.IndexedSlices):
        buffer.scatter_add(
            tf.IndexedSlices(tf.cast(g.values, buffer.dtype), g.indices, g.dense_shape)
        )
    else:
        buffer.assign_add(tf.cast(g, buffer.dtype))


def mark_touched(flags):
    """Sets the touched flags `flags` (scalar variables) to 1."""
    for flag in flags:
        flag.assign(tf.ones((), flag.dtype))


def touched_mask(flags):
    """The touched flags as Python list of scalar bool tensors."""
    return [flag.read_value() > 0 for flag in flags]


def accumulate(state, indices, grads, loss_scale=None, on_skip=None):
    """One micro-step: adds `grads` (of the variables `indices`) to their buffers if all
    are finite, and sets their touched flags.

    `loss_scale` (a variable or None): gradients are divided by it before they
    are added, so buffers hold unscaled sums even if the scale changes inside
    the window. `on_skip` runs when the micro-batch is skipped.
    """

    def add():
        for i, g in zip(indices, grads):
            if loss_scale is not None:
                g = scale_gradient(g, 1.0 / tf.cast(loss_scale, tf.float64))
            add_to(state.buffers[i], g)
        mark_touched([state.touched[i] for i in indices])
        state.window_count.assign_add(1)

    def skip():
        if on_skip is not None:
            on_skip()

    tf.cond(all_finite(grads), add, skip)
    state.window_steps.assign_add(1)


def mean_gradients(buffers, window_count, loss_scale=None):
    """`buffer / window_count` for each buffer (times `loss_scale` if given)."""
    means = []
    for buffer in buffers:
        mean = buffer.read_value() / tf.cast(window_count, buffer.dtype)
        if loss_scale is not None:
            mean = mean * tf.cast(loss_scale, buffer.dtype)
        means.append(mean)
    return means


def end_window(state, apply_fn):
    """Calls `apply_fn()` if the window kept a micro-batch, then starts a new window
    (buffers, counters and touched flags zeroed)."""
    tf.cond(state.window_count > 0, apply_fn, lambda: None)
    for buffer in list(state.buffers) + list(state.touched):
        buffer.assign(tf.zeros(buffer.shape, buffer.dtype))
    state.window_steps.assign(0)
    state.window_count.assign(0)


def maybe_end_window(steps_per_update, window_steps, end_fn):
    """Calls `end_fn()` (in a `tf.cond`) when the window is full."""
    tf.cond(window_steps >= steps_per_update, end_fn, lambda: None)


def flush(window_steps, end_fn):
    """Calls `end_fn()` (in a `tf.cond`) if the window holds any micro-step."""
    tf.cond(window_steps > 0, end_fn, lambda: None)


def guarded(touched, fn):
    """Runs `fn()` only where the scalar bool tensor `touched` is true (`fn` always if None)."""
    if touched is None:
        return fn()

    def run():
        fn()
        return tf.constant(True)

    return tf.cond(touched, run, lambda: tf.constant(False))


def protect_untouched(variables, touched):
    """For variables with a constraint (or Keras 3's `overwrite_with_gradient`), which
    the inner optimizer changes outside its per-variable update: returns a function
    that restores, after the inner update, those left untouched by the window.
    A select (`tf.where`), not a branch, so it also works in replica context."""
    saved = []
    for variable, flag in zip(variables, touched):
        if getattr(variable, "constraint", None) is not None or getattr(
            variable, "overwrite_with_gradient", False
        ):
            saved.append((variable, flag, tf.identity(tf.convert_to_tensor(variable))))

    def restore():
        for variable, flag, old in saved:
            variable.assign(tf.where(flag, tf.convert_to_tensor(variable), old))

    return restore


def masked_update_hooks(api, optimizer, touched_of):
    """The instance attributes (for `accum._shadow.shadowed`) that guard `optimizer`'s per-variable
    updates (`api.UPDATE_STEPS`, each called `(gradient, variable, ...)`) and its weight
    decay (`api.WEIGHT_DECAY`, if any) with the flag `touched_of(variable)` (a scalar bool
    tensor, or None: not guarded), so an untouched variable and its slots stay as they
    are. `api`: the family's `accum._inner.InnerApi`."""

    def guard(update):
        return lambda gradient, variable, *args, **kwargs: guarded(
            touched_of(variable), lambda: update(gradient, variable, *args, **kwargs)
        )

    hooks = {name: guard(getattr(optimizer, name)) for name in api.UPDATE_STEPS}
    if api.WEIGHT_DECAY is not None:
        hooks[api.WEIGHT_DECAY] = lambda variables: masked_weight_decay(
            optimizer, variables, touched_of, api
        )
    return hooks


def masked_weight_decay(optimizer, variables, touched_of, api):
    """Decoupled weight decay (`variable -= variable * weight_decay * learning_rate`, the
    Keras 3 and tf_keras formula) applied only to variables whose flag `touched_of(v)`
    is true. Written as those optimizers' distributed weight decay, with the branch
    inside each variable's update (a `tf.cond` around a `merge_call` fails). `api`: the
    family's `accum._inner.InnerApi`."""
    if optimizer.weight_decay is None:
        return

    def decay(variable):
        if not api.uses_weight_decay(optimizer, variable):
            return

        def fn(var):
            lr = tf.cast(optimizer.learning_rate, var.dtype)
            wd = tf.cast(optimizer.weight_decay, var.dtype)
            var.assign_sub(var * wd * lr)

        target = variable if isinstance(variable, tf.Variable) else variable.value  # Keras 3
        return target, lambda var: guarded(touched_of(var), lambda: fn(var))

    pairs = [p for p in (decay(v) for v in variables) if p is not None]

    def cross_replica(distribution):
        for target, fn in pairs:
            distribution.extended.update(target, fn, group=False)

    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        tf.distribute.get_replica_context().merge_call(cross_replica)
    else:
        cross_replica(tf.distribute.get_strategy())


class Window:
    """`mode="buffer"` in TensorFlow ops (tf_keras; Keras 3's is
    `accum.keras3._buffer_step.BufferWindow`): a step (`accum.modes._modes.step_for`) over
    what the family gives (`ops`, an `accum.modes._family.Family`)."""

    def micro_step(self, ops, grads, indices):
        """Adds `grads` (of the variables `indices`) unless one is non-finite, ends the
        window when full, counts the micro-step (returns the counter's update)."""
        state = ops.window_state()
        accumulate(state, indices, grads, ops.loss_scale(), ops.on_skip)
        maybe_end_window(ops.steps_per_update, state.window_steps, lambda: self.end_window(ops))
        return ops.count_micro_step()

    def end_window(self, ops):
        """Applies the window's mean to the variables it touched (if it kept a micro-batch)
        and starts a new one; the linked `accum.BatchNormalization` layers end theirs."""
        end_window(ops.window_state(), lambda: self._apply_mean(ops))
        ops.finish_batch_norm()

    def flush(self, ops):
        """Ends the window now if it holds a micro-step."""
        flush(ops.window_state().window_steps, lambda: self.end_window(ops))

    @staticmethod
    def _apply_mean(ops):
        state = ops.window_state()
        grads = mean_gradients(state.buffers, state.window_count, ops.loss_scale())
        ops.apply_inner(grads, tuple(range(len(state.variables))), touched_mask(state.touched))
