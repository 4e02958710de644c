"""The accumulation modes as objects: what each builds, does at a micro-step and at the
window's end, and whether it can be distributed or flushed.

`AccumOptimizer(..., mode=name)` validates the name (`_validation.check_mode`) and
keeps `MODES[name]` as `_mode`; the families ask it instead of comparing names:

| | `Buffer` | `Momentum` | `Rescale` |
|---|---|---|---|
| needs of the optimizer (`rule`) | nothing | a `MomentumRule` (SGD/Adam/AdamW) | a `_rescale.Rescale` spec |
| builds | a buffer and a touched flag per variable | a touched flag per variable | nothing |
| a micro-step | adds to the buffers (`accum.modes._window`; Keras 3: `accum.keras3._buffer_step`) | folds into the moments | rescaled inner update (`accum.modes._rescale`) |
| the window's end | the inner optimizer on the mean | the rule's `finish` | -- (each micro-step) |
| `k=1` | the inner optimizer, gradients as given | as for any `k` | as for any `k` |
| `tf.distribute`, `flush()` | yes | no | no |

A mode calls the family's implementation through the wrapper's hooks, declared
in `AccumOptimizer` (`_window_state`, `_window_variables`, `_apply_inner`, `_loss_scale`, `_on_skip`,
`_momentum_rule_for`, `_rescale_spec_for`, `_rescale_check_variables`,
`_rescale_micro_step`).
"""

from . import _window


def mode_not_supported(mode):
    """The error for a mode other than "buffer" (`"momentum"`, `"rescale"`) under a strategy."""
    return NotImplementedError(
        f'`AccumOptimizer(..., mode="{mode}")` is not supported under a '
        "`tf.distribute` strategy: its moment slots are mirrored variables "
        "that it would update from each replica's own gradients at every "
        'micro-step. Use `mode="buffer"` (the default), which accumulates '
        "locally on each replica and all-reduces once per update."
    )


class Mode:
    """One accumulation mode (see the module's table)."""

    name = ""
    buffered = False  # a buffer per variable; k=1 hands each micro-step to the inner optimizer
    flags_touched = True  # a flag per variable: did the window give it a gradient
    distributable = False  # under `tf.distribute`: replica-local windows (`accum.modes._distributed`)
    own_micro_step = False  # its micro-step replaces the window (accumulate, count, end)

    def rule(self, wrapper, optimizer, k):
        """What the mode needs of `optimizer`, refusing one it cannot handle (or None)."""
        return None

    def check_variables(self, wrapper, variables):
        """Refuses, before anything is built, variables the mode cannot update."""

    def check_built(self, wrapper, optimizer, variables):
        """Refuses, once the inner `optimizer` built its slots, what the mode cannot fold into."""

    def check_distributable(self):
        if not self.distributable:
            raise mode_not_supported(self.name)

    def accumulate(self, wrapper, grads, indices):
        """What one micro-step does to the window (`own_micro_step` modes: `micro_step`)."""
        raise NotImplementedError(self.name)

    def micro_step(self, wrapper, grads, indices):
        """The whole micro-step of an `own_micro_step` mode."""
        raise NotImplementedError(self.name)

    def end_window(self, wrapper):
        """Applies the window (if it kept any micro-batch) and starts a new one; the
        linked `accum.BatchNormalization` layers end theirs."""
        _window.end_window(wrapper._window_state(), self.window_end(wrapper))
        wrapper._finish_batch_norm()

    def window_end(self, wrapper):
        """The update at the window's end."""
        return lambda: wrapper._rule.finish(wrapper._window_variables())

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

    def accumulate(self, wrapper, grads, indices):
        _window.accumulate(wrapper._window_state(), indices, grads, wrapper._loss_scale(),
                           wrapper._on_skip)

    def window_end(self, wrapper):
        def apply_mean():
            state = wrapper._window_state()
            grads = _window.mean_gradients(state.buffers, state.window_count, wrapper._loss_scale())
            indices = tuple(range(len(state.variables)))
            wrapper._apply_inner(grads, indices, _window.touched_mask(state.touched))

        return apply_mean

    def pending(self, k):
        return (f"steps_per_update={k}",
                "They stay in the buffer and join the next window; call "
                "`optimizer.flush()` to apply them now, or pass "
                "`callbacks=[optimizer.flush_callback()]` to `fit`.")


class Momentum(Mode):
    name = "momentum"

    def rule(self, wrapper, optimizer, k):
        return wrapper._momentum_rule_for(optimizer)

    def check_built(self, wrapper, optimizer, variables):
        wrapper._rule.check_built(optimizer, variables)

    def accumulate(self, wrapper, grads, indices):
        wrapper._rule.accumulate(wrapper._window_variables(), wrapper.steps_per_update, grads, indices)

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
    own_micro_step = True

    def rule(self, wrapper, optimizer, k):
        return wrapper._rescale_spec_for(optimizer, k)

    def check_variables(self, wrapper, variables):
        wrapper._rescale_check_variables(variables)  # the coefficients in the variables' dtypes

    def micro_step(self, wrapper, grads, indices):
        return wrapper._rescale_micro_step(grads, indices)

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
