"""`Family`: everything a mode, a step and `accum.modes._distributed` ask of a family, declared once.

Each family's wrapper builds one object implementing it (`AccumOptimizer._ops`, in
`_init_window`): `accum._base.WrapperOps` implements what every family shares (the
wrapper's `k`, rule, strategy, `accum.BatchNormalization` layers, the `"momentum"`
and `"rescale"` entry points into the family's modules); `accum.keras3._optimizer.Keras3Ops`
and `accum.tf_keras._common.TFKerasOps` the rest. The modes (`accum.modes._modes`) and
the steps (`step_for`) receive it as their `ops` argument and never see the wrapper,
in the spirit of optax's `MultiSteps` (one state, one `update`) around Keras's
`LossScaleOptimizer` (a wrapper holding `inner_optimizer`).

| operation | what | used by |
|---|---|---|
| `steps_per_update` | `k` | every step |
| `rule` | the mode's rule for the inner optimizer (`MomentumRule`, `Rescale`, None) | `"momentum"`, `"rescale"` |
| `strategy` | the `tf.distribute` strategy at `build`, or None | `_distributed` |
| `rescale_steps` | the family's `"rescale"` module: `spec_for(optimizer, k)`, `check_variables(spec, variables)`, `micro_step(state, grads, indices)` (`accum.keras3._rescale_step`, `accum.tf_keras._rescale_step`) | `Rescale` |
| `window_state()` | the window (`accum.modes._window.WindowState`) as `tf.Variable`s | `"momentum"`, `_window.Window`, `_distributed` |
| `window_variables()` | the same, as the family's own variables | `"momentum"` |
| `buffer_window()` | the family's `"buffer"` step | `Buffer.step` |
| `apply_inner(grads, indices, touched)` | the inner update, only touched variables changing | `_window.Window`, `_distributed` |
| `apply_as_given(grads, indices)` | the inner update of the gradients as given (`k=1`) | `PassThrough` |
| `count_micro_step()` | `micro_steps += 1`; returns its update | `PassThrough`, `"momentum"`, `_window.Window` |
| `loss_scale()`, `on_skip()` | the inner loss scale (or None); what it does with a non-finite micro-batch | `_window.Window`, `_distributed` |
| `inner_scope()` | a context around the replicas' `apply_inner` | `_distributed` |
| `finish_batch_norm(when, reduce)` | the window's end of the linked `accum.BatchNormalization` layers | every window's end |
| `momentum_rule_for(optimizer)` | `"momentum"`'s `MomentumRule` (or a `ValueError`) | `Momentum.rule` |
| `rescale_state()` | the wrapper's state a `"rescale"` micro-step works on (`accum.modes._rescale.Step`) | `Rescale` |

`momentum_rule_for` and `rescale_steps` are the class's: a mode's `rule` is asked of the
family's class (the wrapper is not built yet); `strategy` is set at `build`.
"""

import contextlib


class Family:
    """The operations a mode needs from a family (see the module's table); each method
    here raises, or does what a family without the feature does."""

    steps_per_update = None
    rule = None
    strategy = None
    rescale_steps = None

    def window_state(self):
        """The window's state (`accum.modes._window.WindowState`) as `tf.Variable`s."""
        raise NotImplementedError

    def window_variables(self):
        """The window's state as the family's own variables (`"momentum"` assigns them)."""
        return self.window_state()

    def buffer_window(self):
        """The family's `mode="buffer"` step (`micro_step(ops, grads, indices)`,
        `end_window(ops)`, `flush(ops)`): Keras 3's in `keras.ops`
        (`accum.keras3._buffer_step.BufferWindow`), TensorFlow's (`accum.modes._window.Window`)."""
        raise NotImplementedError

    def apply_inner(self, grads, indices, touched):
        """The inner optimizer's update of the variables `indices` with `grads`, where only
        those whose `touched` (scalar bool tensors) is true change."""
        raise NotImplementedError

    def apply_as_given(self, grads, indices):
        """The inner optimizer's update of the variables `indices` with `grads` as given
        (sparse ones stay sparse): `k=1`."""
        raise NotImplementedError

    def count_micro_step(self):
        """Counts a micro-step (`micro_steps += 1`); returns the counter's update."""
        raise NotImplementedError

    def loss_scale(self):
        """The inner loss scale that micro-gradients are divided by before they are added
        (a variable), or None: the family's inner optimizer unscales itself."""
        return None

    def on_skip(self):
        """What the inner loss-scale optimizer does with a non-finite micro-batch (nothing
        without one)."""

    def inner_scope(self):
        """A context entered (cross-replica context) around the replicas' `apply_inner`."""
        return contextlib.nullcontext()

    def finish_batch_norm(self, when=True, reduce=None):
        """The window's end for the linked `accum.BatchNormalization` layers, where the
        scalar bool `when` holds (`reduce`: see `accum.batchnorm._layer.finish_windows`)."""
        raise NotImplementedError

    @staticmethod
    def momentum_rule_for(optimizer):
        """`mode="momentum"`: the family's `accum.modes._momentum.MomentumRule` for `optimizer`."""
        raise NotImplementedError

    def rescale_state(self):
        """`mode="rescale"`: the wrapper's state (`accum.modes._rescale.Step`) that
        `rescale_steps.micro_step` works on."""
        raise NotImplementedError
