"""Keras 3 (`keras`, TensorFlow backend): what a recomputation must capture and restore.

Uses a few private Keras names -- the call context that carries `training` to
sublayers, the autocast scope of mixed precision, the global seed generator and
the per-layer loss lists -- because Keras has no public API for them; they are
all read here and nowhere else.
"""

import contextlib

name = "Keras 3"


def _keras():
    import keras  # imported lazily: a tf_keras-only process never pays for it

    return keras


def check_supported(layer):
    backend = _keras().backend.backend()
    if backend != "tensorflow":
        raise NotImplementedError(
            "`recompute_grad` supports Keras 3 with the TensorFlow backend only. "
            f"Received: layer '{layer.name}' running on the {backend!r} backend. "
            "Set KERAS_BACKEND=tensorflow, or unset RECOMPUTE to run without it."
        )


def sublayers(layer):
    return layer._flatten_layers(include_self=True, recursive=True)


def _tf_variable(variable):
    return getattr(variable, "_value", variable)


def state_variables(layer):
    """Variables a call may change: seeds, moving statistics, metric state.

    Returned as the underlying `tf.Variable`s, de-duplicated, in a stable order.
    Includes the global seed generator that unseeded `keras.random` calls use.
    """
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    found = list(layer.non_trainable_variables) + list(layer.metrics_variables)
    global_gen = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    if global_gen is not None:
        found.append(global_gen.state)
    out, seen = [], set()
    for v in found:
        tv = _tf_variable(v)
        if tv is None or id(tv) in seen:
            continue
        seen.add(id(tv))
        out.append(tv)
    return out


def capture_call_state(layer):
    """Returns a factory of context managers that re-enter the forward call's context.

    The recomputation runs in the backward pass, outside `Layer.__call__`, so the
    call context (which passes `training` down to sublayers) and the mixed
    precision autocast scope that were active in the forward pass are re-entered.
    """
    from keras.src import backend
    from keras.src.backend.common import global_state

    call_ctx = global_state.get_global_attribute("current_call_ctx")
    autocast = backend.get_autocast_scope()

    @contextlib.contextmanager
    def reenter():
        previous = global_state.get_global_attribute("current_call_ctx")
        global_state.set_global_attribute("current_call_ctx", call_ctx)
        try:
            if autocast is not None:
                with backend.AutocastScope(autocast.dtype):
                    yield
            else:
                yield
        finally:
            global_state.set_global_attribute("current_call_ctx", previous)

    return reenter


def save_python_state(layers):
    """Returns a function that undoes `add_loss` calls made after this point."""
    saved = [(lyr, len(lyr._losses), set(lyr._loss_ids)) for lyr in layers]

    def restore():
        for lyr, n_losses, loss_ids in saved:
            del lyr._losses[n_losses:]
            lyr._loss_ids.clear()
            lyr._loss_ids.update(loss_ids)

    return restore


def legacy_random_generators(layers):
    return []  # Keras 3 draws every random number from a SeedGenerator


def replay_legacy_rng(generators, seed):
    return contextlib.nullcontext()


def is_variable(value):
    return isinstance(value, _keras().Variable)
