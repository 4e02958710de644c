"""The accumulation modes as objects, and `step_for`: which step a wrapper's micro-step runs.

`AccumOptimizer(..., mode=name)` validates the name (`_validation.check_mode`) and
keeps `MODES[name]` as `_mode`; the families ask it instead of comparing names:

| | `Buffer` | `Momentum` | `Rescale` |
|---|---|---|---|
| needs of the optimizer (`rule`) | nothing | a `MomentumRule` (SGD/Adam/AdamW) | a `_rescale.Rescale` spec |
| builds | a buffer and a touched flag per variable | a touched flag per variable | nothing |
| its step (`step`) | the family's window (`ops.buffer_window()`: `accum.keras3._buffer_step.BufferWindow`; `accum.modes._window.Window`) | itself: folds into the moments | itself: the family's rescaled inner update (`accum.modes._rescale`) |
| the window's end | the inner optimizer on the mean | the rule's `finish` | -- (each micro-step) |
| `k=1` | `PassThrough`: the inner optimizer, gradients as given | as for any `k` | as for any `k` |
| `tf.distribute`, `flush()` | yes (`accum.modes._distributed.LOCAL_WINDOW`) | no | no |

A step is an object with `micro_step(ops, grads, indices)` (returns the micro-step
counter's update, or None), `end_window(ops)` and `flush(ops)`; `step_for` selects it,
once per wrapper and context (at `build`), and a family's micro-step is one call of it.
`ops` is the family's `accum.modes._family.Family`: the one way a mode reaches a family.
"""

from . import _distributed, _window


def mode_not_supported(mode):
    """The error for a mode other than "buffer" (`"momentum"`, `"rescale"`) under a strategy."""
    return NotImplementedError(
        f'`AccumOptimizer(..., mode="{mode}")` is not supported under a '
        "`tf.distribute` strategy: its moment slots are mirrored variables "
        "that it would update from each replica's own gradients at every "
        'micro-step. Use `mode="buffer"` (the default), which accumulates '
        "locally on each replica and all-reduces once per update."
    )


def passes_through(mode, k):
    """Whether a micro-step goes to the inner optimizer as given (`"buffer"`, `k=1`): then
    it is no window's, and under a strategy its gradients are all-reduced as usual."""
    return k == 1 and mode.buffered


def step_for(mode, k, local, ops):
    """The step a micro-step runs: `PassThrough` where `passes_through`; in a replica
    context of a strategy (`local`), the replica-local window
    (`accum.modes._distributed.LOCAL_WINDOW`, `"buffer"`) or `Refused`; otherwise the
    mode's own (`mode.step(ops)`). Cheap: it builds nothing."""
    if local:
        step = _distributed.LOCAL_WINDOW if mode.distributable else Refused(mode)
    else:
        step = mode.step(ops)
    return PassThrough(step) if passes_through(mode, k) else step


class PassThrough:
    """`"buffer"` with `k=1`: each micro-step is an update, the inner optimizer's on the
    gradients as given (sparse ones stay sparse). A window restored with pending
    micro-steps is still ended or flushed by `window`, the step it stands for."""

    def __init__(self, window):
        self.window = window

    def micro_step(self, ops, grads, indices):
        ops.apply_as_given(grads, indices)
        ops.finish_batch_norm()
        return ops.count_micro_step()

    def end_window(self, ops):
        self.window.end_window(ops)

    def flush(self, ops):
        self.window.flush(ops)


class Refused:
    """The step of a mode that cannot be distributed, in a replica context: raises."""

    def __init__(self, mode):
        self.mode = mode

    def micro_step(self, ops, grads, indices):
        self.mode.check_distributable()

    def end_window(self, ops):
        self.mode.check_distributable()

    flush = end_window


class Mode:
    """One accumulation mode (see the module's table); `Momentum` and `Rescale` are their
    own steps."""

    name = ""
    buffered = False  # a buffer per variable; k=1 hands each micro-step to the inner optimizer
    flags_touched = True  # a flag per variable: did the window give it a gradient
    distributable = False  # under `tf.distribute`: replica-local windows (`accum.modes._distributed`)

    def rule(self, ops, optimizer, k):
        """What the mode needs of `optimizer`, refusing one it cannot handle (or None);
        `ops` is the family's `Family` class (no wrapper is built yet)."""
        return None

    def check_variables(self, ops, variables):
        """Refuses, before anything is built, variables the mode cannot update."""

    def check_built(self, ops, optimizer, variables):
        """Refuses, once the inner `optimizer` built its slots, what the mode cannot fold into."""

    def check_distributable(self):
        if not self.distributable:
            raise mode_not_supported(self.name)

    def step(self, ops):
        """The mode's step outside a replica context (see `step_for`)."""
        return self

    def micro_step(self, ops, grads, indices):
        """One micro-step (the mode as its own step)."""
        raise NotImplementedError(self.name)

    def end_window(self, ops):
        """Applies the window (if it kept any micro-batch) and starts a new one."""

    def flush(self, ops):
        self.check_flushable(ops.steps_per_update)

    def check_flushable(self, k):
        """Raises unless `flush()` can apply a partial window."""

    def pending(self, k):
        """(the window, the micro-steps' fate): what the warning about micro-steps pending at
        the end of training says."""
        raise NotImplementedError(self.name)


class Buffer(Mode):
    name = "buffer"
    buffered = True
    distributable = True

    def step(self, ops):
        return ops.buffer_window()

    def pending(self, k):
        return (f"steps_per_update={k}",
                "They stay in the buffer and join the next window; call "
                "`optimizer.flush()` to apply them now, or pass "
                "`callbacks=[optimizer.flush_callback()]` to `fit`.")


class Momentum(Mode):
    name = "momentum"

    def rule(self, ops, optimizer, k):
        return ops.momentum_rule_for(optimizer)

    def check_built(self, ops, optimizer, variables):
        ops.rule.check_built(optimizer, variables)

    def micro_step(self, ops, grads, indices):
        """Folds `grads` into the moments, ends the window when full, counts the micro-step."""
        ops.rule.accumulate(ops.window_variables(), ops.steps_per_update, grads, indices)
        _window.maybe_end_window(
            ops.steps_per_update, ops.window_state().window_steps, lambda: self.end_window(ops))
        return ops.count_micro_step()

    def end_window(self, ops):
        """The rule's `finish` (if the window kept a micro-batch); the linked
        `accum.BatchNormalization` layers end their windows."""
        _window.end_window(ops.window_state(), lambda: ops.rule.finish(ops.window_variables()))
        ops.finish_batch_norm()

    def check_flushable(self, k):
        # The slot holds `decay * m_old + scale * sum(g_i) / k` once a micro-step is
        # folded in: re-normalizing the sum by a count c < k needs `m_old` or the sum
        # apart, i.e. a buffer, which is what this mode does without.
        raise ValueError(
            '`flush()` needs `mode="buffer"`: with `mode="momentum"` each micro-gradient '
            "is folded into the inner optimizer's moments as it arrives, scaled by "
            f"1/steps_per_update (1/{k}), so a partial window cannot be "
            "normalized by its count afterwards (the moment from before the window and "
            "the window's sum are one tensor by then; applying it would count the missing "
            "micro-batches as zero gradients). Leave the partial window pending: it is "
            "carried into the next window, exactly (as `fit` does across epochs); or use "
            '`mode="buffer"` to flush partial windows. Received: mode="momentum"'
        )

    def pending(self, k):
        return (f"steps_per_update={k}, mode=\"momentum\"",
                "They are folded into the inner optimizer's moments and join the next "
                "window; if training stops here they never reach the weights "
                "(`flush()` needs mode=\"buffer\").")


class Rescale(Mode):
    name = "rescale"
    flags_touched = False  # every variable gets a gradient at every micro-step

    def rule(self, ops, optimizer, k):
        return ops.rescale_steps.spec_for(optimizer, k)

    def check_variables(self, ops, variables):
        # The coefficients in the variables' dtypes.
        ops.rescale_steps.check_variables(ops.rule, variables)

    def micro_step(self, ops, grads, indices):
        """The family's rescaled inner update; it counts the micro-step and moves the
        weights at the window's last (the window ends there: nothing is left for `end_window`)."""
        return ops.rescale_steps.micro_step(ops.rescale_state(), grads, indices)

    def check_flushable(self, k):
        raise ValueError(
            '`flush()` needs `mode="buffer"`: with '
            '`mode="rescale"` the micro-steps of a window are already in the inner '
            "optimizer's moving averages, and the weights move only at the window's "
            f"last micro-step (every {k}-th). Received: mode=\"rescale\""
        )

    def pending(self, k):
        return (f"steps_per_update={k}, mode=\"rescale\"",
                "They are in the inner optimizer's moving averages and move the weights "
                "at the next update (the window's last micro-step).")


MODES = {mode.name: mode for mode in (Buffer(), Momentum(), Rescale())}
