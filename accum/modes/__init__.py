"""The accumulation modes, written once for every family (TensorFlow ops).

| module | what |
|---|---|
| `_family` | `Family`: every operation a mode, a step or `_distributed` asks of a family, declared once (each family implements it, `accum._base.WrapperOps` the shared part) |
| `_modes` | `Buffer`, `Momentum`, `Rescale`: what each mode needs of the optimizer, builds, does at a micro-step and at the window's end, whether it can be distributed or flushed (`MODES[name]`, the wrapper's `_mode`); `step_for`, the one selection of the step a micro-step runs (`PassThrough` for `k=1`) |
| `_window` | the window's state (`WindowState`) and its TensorFlow ops: add, count, mean, end, the masked (touched-only) update; `Window`, `"buffer"`'s step in those ops (tf_keras) |
| `_distributed` | `"buffer"` under `tf.distribute`, every family: replica-local buffers, the window's end in the cross-replica context (`Window`), one batched all-reduce per update; `LOCAL_WINDOW`, its step |
| `_momentum` | `mode="momentum"`: the derivation, `rule_for` and `MomentumRule`, folding micro-gradients into the inner optimizer's slots (read through the family's `accum._inner.InnerApi`, `SlotAdapter`) |
| `_rescale` | `mode="rescale"`: the derivation and `Rescale`, the rewritten coefficients `β̃ = 1 − (1 − β)/k`; `Step`, the wrapper's state a family's micro-step works on |

A step is an object with `micro_step(ops, grads, indices)`, `end_window(ops)` and
`flush(ops)`; `ops` is the family's `Family`, the only way anything here reaches a
family (no mode calls into a wrapper).

Imports: `_modes` -> `_distributed` -> `_window`; `_momentum` -> `_window`; `_family`
and `_rescale` stand alone. Nothing here imports a family package: each family gives
the modes what is its own -- `accum.keras3` (the Keras 3 window in `keras.ops`, its
rescaled micro-step) and `accum.tf_keras` (the same for tf_keras) -- through its
`Family` object, and its `accum._inner.InnerApi` module (the slots `"momentum"`
folds into).
"""
