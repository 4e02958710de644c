"""The warning when a model is compiled again while its `AccumOptimizer` holds pending micro-steps.

`model.compile(new_optimizer)` replaces the model's optimizer: micro-steps
pending in the old `AccumOptimizer`'s window (in its buffers, or folded into
its inner optimizer's moments) never reach the weights. Keras tells an
optimizer nothing when it is replaced, so the model is told instead: when an
`AccumOptimizer` is built, or finalized at the end of `fit`, from a method of
the model (`fit`, `train_on_batch`: the model is `self` in a calling frame
whose `optimizer` is or wraps the `AccumOptimizer`, `accum._callers.model_calling`,
as `accum.batchnorm._warning` finds it), the model's `compile` becomes `guarded_compile` bound to it (an
instance method, `accum._shadow.replace_methods`; it calls the class's own `compile`;
the families' `_inner` list `Model.compile` in `PRIVATE_NAMES`). In a custom loop no
model is found and nothing is installed.

`guarded_compile` warns when the optimizer being replaced is, or wraps, an
`AccumOptimizer` with pending micro-steps that the new optimizer does not wrap
(compiling again with the same `AccumOptimizer` keeps its window).
"""

import warnings

from . import _callers, _shadow
from ._callers import chain


def is_accum_optimizer(optimizer):
    """True for an `AccumOptimizer` of any family: it counts its pending micro-steps.
    (A test of the protocol, not of the class: `_base` imports this module.)"""
    return callable(getattr(optimizer, "_pending_micro_steps", None))


def guard_training_model(optimizer):
    """Installs `guarded_compile` on the model `optimizer` is training, if one is found
    (once per model; not over a `compile` the instance already overrides)."""
    model = _callers.model_calling(optimizer)
    if model is None or "compile" in vars(model):
        return
    _shadow.replace_methods(model, {"compile": guarded_compile})


def guarded_compile(self, *args, **kwargs):
    """The model's `compile` (see `type(model).compile`), after warning if the
    `AccumOptimizer` it replaces has pending micro-steps (`accum._recompile`)."""
    new = args[0] if args else kwargs.get("optimizer")
    warn_if_dropped(getattr(self, "optimizer", None), new, stacklevel=2)
    return type(self).compile(self, *args, **kwargs)


def warn_if_dropped(old, new, stacklevel=2):
    """Warns for each `AccumOptimizer` in `old`'s chain, absent from `new`'s, with
    micro-steps pending in its window (`stacklevel`: as `warnings.warn`'s, for the caller)."""
    kept = chain(new) if not isinstance(new, str) else []
    for optimizer in chain(old):
        if not is_accum_optimizer(optimizer) or any(o is optimizer for o in kept):
            continue
        pending = optimizer._pending_micro_steps()
        if not pending:
            continue
        k = optimizer.steps_per_update
        if optimizer._mode.buffered:
            avoid = ("call the AccumOptimizer's `flush()` before `compile` to apply them now "
                     "(or pass `callbacks=[optimizer.flush_callback()]` to `fit`).")
        else:
            avoid = (f"`flush()` needs mode=\"buffer\", so compile again at a window's end, "
                     f"after a multiple of {k} micro-steps.")
        warnings.warn(
            f"AccumOptimizer: compiling the model with another optimizer drops the {pending} "
            f"micro-step(s) pending in the window of its AccumOptimizer "
            f"(steps_per_update={k}, mode=\"{optimizer.mode}\"): they never reach the weights. "
            f"To keep them, {avoid}",
            stacklevel=stacklevel + 1,
        )

