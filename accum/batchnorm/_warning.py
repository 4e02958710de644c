"""The BatchNormalization warning: accumulation cannot reproduce big-batch statistics.

Each micro-batch is normalized with its own mean and variance (and moves the
moving statistics once per micro-batch), so a model with BatchNormalization
trained with `k` micro-batches of `b` differs from batch `k * b` however exact
the gradient accumulation is. Group/LayerNormalization have no batch
statistics and accumulate exactly.
"""

import warnings

from .._callers import model_calling


def _layers(layer, seen):
    if id(layer) in seen:
        return
    seen.add(id(layer))
    yield layer
    children = getattr(layer, "_flatten_layers", None)
    if callable(children):
        for child in children(include_self=False, recursive=False):
            yield from _layers(child, seen)
    else:
        for child in getattr(layer, "layers", None) or ():
            yield from _layers(child, seen)


def has_batch_normalization(model):
    """True if `model` (a Keras 3 or tf_keras model or layer) contains a BatchNormalization
    layer other than `accum.BatchNormalization`."""
    from ._layer import BatchNormalization as WindowBatchNormalization

    return any(
        "BatchNormalization" in {cls.__name__ for cls in type(layer).__mro__}
        and "Synchronized" not in type(layer).__name__
        and not isinstance(layer, WindowBatchNormalization)
        or type(layer).__name__ == "SyncBatchNormalization"
        for layer in _layers(model, set())
    )


def warn_if_batch_normalization(model, steps_per_update=None):
    """Warns (`UserWarning`) if `model` contains BatchNormalization. Returns whether it did."""
    if not has_batch_normalization(model):
        return False
    k = f" (steps_per_update={steps_per_update})" if steps_per_update else ""
    warnings.warn(
        f"AccumOptimizer{k}: the model contains BatchNormalization. Gradient "
        "accumulation cannot reproduce big-batch statistics: every micro-batch "
        "is normalized with its own mean and variance, and moves the moving "
        "statistics once per micro-batch. Use `accum.BatchNormalization` (a "
        "drop-in layer whose moving statistics are those of the whole batch, "
        "updated once per window), or GroupNormalization/LayerNormalization.",
        stacklevel=3,
    )
    return True


def warn_for_training_model(optimizer):
    """Called from `build`: finds the model being trained with `optimizer` and checks it.

    `model.fit`, `train_on_batch` and `compile` build the optimizer from a
    method of the model, so the model is `self` in a calling frame whose
    `optimizer` is (or wraps) this optimizer (`accum._callers.model_calling`). In
    a custom loop no model is found: call `warn_if_batch_normalization(model)` there.
    """
    model = model_calling(optimizer)
    if model is None:
        return False
    return warn_if_batch_normalization(model, optimizer.steps_per_update)
