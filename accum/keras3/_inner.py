"""`accum._inner.InnerApi` for Keras 3 optimizers (TensorFlow and JAX backends).

The only place in `accum` where private names of a wrapped Keras 3 optimizer
are touched, with the readers it shares with tf_keras new-style (`var_key`,
`uses_weight_decay`, `has_momentum`, `build`, `own_variables`, `own_iterations`,
`accum._inner`) (`PRIVATE_NAMES`; tests/accum_keras3/test_inner_interface.py
checks them against the installed Keras).
"""

import keras

from .. import _families, _shadow
from .._inner import owned_by, reader, shared_private_names
from .._inner import (  # noqa: F401 (members of this family's interface)
    build, has_momentum, moment_slots, own_iterations, own_variables, uses_weight_decay, var_key)

name = _families.KERAS3
UPDATE_STEPS = ("update_step",)  # public, but hooked by name
WEIGHT_DECAY = "_apply_weight_decay"

_EVERY = tuple(
    f"keras.optimizers.{cls}"
    for cls in ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta",
                "Adafactor", "Ftrl", "Lion", "Lamb")
)
_MOMENTUM = ("keras.optimizers.SGD", "keras.optimizers.Adam", "keras.optimizers.AdamW")
_ADAM = _MOMENTUM[1:]
# The wrapper's own base class, `keras.optimizers.Optimizer` (as SGD has it): the state the
# wrapper (`accum.keras3._optimizer`, `accum.keras3._jax`, `accum.keras3._rescale_step`) reads of itself.
_WRAPPER_BASE = ("keras.optimizers.SGD",)

PRIVATE_NAMES = (
    shared_private_names(_EVERY, _ADAM, _WRAPPER_BASE)
    # `_all_reduce_sum_gradients`: TensorFlow backend
    + owned_by(_EVERY, "update_step", "_apply_weight_decay", "_get_current_learning_rate",
               "_iterations", "_all_reduce_sum_gradients")
    + owned_by(_MOMENTUM + _WRAPPER_BASE, "_get_variable_index")
    + owned_by(_WRAPPER_BASE, "_trainable_variables", "_check_variables_are_known")
    + (
        # `accum.local_gradients` (JAX): the mask Keras's losses read; the trainer's metrics update
        ("get_keras_mask", ("keras.src.backend",)),
        ("JAXTrainer._update_metrics_variables", ("keras.src.backend.jax.trainer",)),
    )
    # replaced on a model instance (`accum._shadow.replace_methods`): `compile` by
    # `accum._recompile`, the train step by `accum.keras3._local_jax`
    + owned_by(("keras",), "Model.compile", "Model.train_step", "Model.make_train_function",
               "Model.fit", "Model.train_on_batch")
)


def var_keys(optimizer, variables):
    """`var_key` of each of `variables`, in order."""
    return [optimizer._var_key(v) for v in variables]


def apply_weight_decay(optimizer, variables):
    optimizer._apply_weight_decay(variables)


def weight_decay_where(optimizer, variables, flags, learning_rate=None):
    """Keras 3's decoupled weight decay (`variable -= variable * weight_decay *
    learning_rate`, as `_apply_weight_decay`) as a select: applied to each variable it
    applies to where its flag in `flags` (a scalar bool, or None: always; one per
    variable) holds. `learning_rate`: the optimizer's own if None. (Keras 3 only: the
    masked update and `mode="rescale"`.)"""
    if optimizer.weight_decay is None:
        return
    for variable, flag in zip(variables, flags):
        if uses_weight_decay(optimizer, variable):
            lr = keras.ops.cast(
                optimizer.learning_rate if learning_rate is None else learning_rate, variable.dtype)
            wd = keras.ops.cast(optimizer.weight_decay, variable.dtype)
            new = variable.value - variable.value * wd * lr
            variable.assign(new if flag is None else keras.ops.where(flag, new, variable.value))


def slots(optimizer, variable):
    return moment_slots(optimizer, variable, variable_index, keras.optimizers.SGD,
                        (keras.optimizers.Adam, keras.optimizers.AdamW))


def current_learning_rate(optimizer, dtype=None):
    learning_rate = optimizer._get_current_learning_rate()
    return learning_rate if dtype is None else keras.ops.cast(learning_rate, dtype)


def step_hooks(optimizer, iterations, learning_rate):
    return {
        "_iterations": iterations,
        "_get_current_learning_rate": lambda: learning_rate,
        WEIGHT_DECAY: lambda variables: None,
    }


def skip_all_reduce(optimizer):
    """Keras 3 optimizers all-reduce their gradients inside `apply` (TensorFlow backend,
    `_all_reduce_sum_gradients`) and take no argument to skip it: `optimizer`'s is
    shadowed by the identity (`list`) on the instance while the update is traced."""
    return _shadow.shadowed(optimizer, {"_all_reduce_sum_gradients": list})


def loss_scale(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale, optimizer.step_counter
    return None


# The wrapper's own base-class state (`_WRAPPER_BASE`).


own_trainable_variables = reader(
    "_trainable_variables", "The model variables `optimizer` was built on, in its order.")


def variable_index(optimizer, variable):
    """The index of `variable` among those `optimizer` was built on."""
    return optimizer._get_variable_index(variable)


def variable_indices(optimizer, variables, known=None):
    """The indices of `variables` among those `optimizer` was built on, after a ValueError
    unless it was built on each of `known` (if given)."""
    if known is not None:
        optimizer._check_variables_are_known(known)
    return tuple(optimizer._get_variable_index(v) for v in variables)


def keras_mask(tensor):
    """The Keras mask attached to `tensor` (Keras's losses read it), or None."""
    from keras.src import backend

    return backend.get_keras_mask(tensor)


def update_metrics_variables(model, *args):
    """The JAX trainer's `_update_metrics_variables(metrics, loss, x, y, y_pred,
    sample_weight)` of `model`: `(logs, metrics)`."""
    return model._update_metrics_variables(*args)
