"""The accumulation window (`mode="buffer"`), in TensorFlow ops shared by every backend.

A window is `steps_per_update` micro-steps. Each micro-step adds its gradients
to one buffer per variable (`IndexedSlices` by scatter-add, so a sparse
gradient never becomes a full-size dense tensor) unless they are non-finite,
and counts itself in `window_steps` and, if kept, in `window_count`. The
last micro-step of a window calls `apply_fn` with `buffer / window_count`
(only if some micro-batch was kept), then zeroes the buffers and counters.

Branching is `tf.cond` on variables, never Python `if` on values, so the same
code runs eagerly, in `tf.function` and under XLA (`jit_compile=True`), and
only the branch taken runs.

All variables passed here are `tf.Variable`s (Keras 3 backends pass
`keras.Variable.value`).
"""

import tensorflow as tf


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


def accumulate(buffers, grads, window_steps, window_count, loss_scale=None, on_skip=None):
    """One micro-step: adds `grads` to `buffers` (same order) if all are finite.

    `loss_scale` (a variable or None): gradients are divided by it before they
    are added, so buffers hold unscaled sums even if the scale changes inside
    the window. `on_skip` runs when the micro-batch is skipped.
    """

    def add():
        for buffer, g in zip(buffers, grads):
            if loss_scale is not None:
                g = scale_gradient(g, 1.0 / tf.cast(loss_scale, tf.float64))
            add_to(buffer, g)
        window_count.assign_add(1)

    def skip():
        if on_skip is not None:
            on_skip()

    tf.cond(all_finite(grads), add, skip)
    window_steps.assign_add(1)


def mean_gradients(buffers, window_count, loss_scale=None):
    """`buffer / window_count` for each buffer (times `loss_scale` if given)."""
    means = []
    for buffer in buffers:
        mean = buffer.read_value() / tf.cast(window_count, buffer.dtype)
        if loss_scale is not None:
            mean = mean * tf.cast(loss_scale, buffer.dtype)
        means.append(mean)
    return means


def end_window(all_buffers, window_steps, window_count, apply_fn):
    """Calls `apply_fn()` if the window kept a micro-batch, then starts a new window."""
    tf.cond(window_count > 0, apply_fn, lambda: None)
    for buffer in all_buffers:
        buffer.assign(tf.zeros(buffer.shape, buffer.dtype))
    window_steps.assign(0)
    window_count.assign(0)


def maybe_end_window(steps_per_update, window_steps, end_fn):
    """Calls `end_fn()` (in a `tf.cond`) when the window is full."""
    tf.cond(window_steps >= steps_per_update, end_fn, lambda: None)


def flush(window_steps, end_fn):
    """Calls `end_fn()` (in a `tf.cond`) if the window holds any micro-step."""
    tf.cond(window_steps > 0, end_fn, lambda: None)
