"""`accum._inner.InnerApi` for Keras 3 optimizers (TensorFlow and JAX backends).

The only place in `accum` where private names of a wrapped Keras 3 optimizer
are touched (`PRIVATE_NAMES`; tests/accum_keras3/test_inner_interface.py
checks them against the installed Keras).
"""

import keras

from .. import _shadow

# `accum._families.KERAS3`, not imported: `_families` reads `optimizer_base_class` here
name = "keras3"
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
    ("update_step", _EVERY),
    ("_var_key", _EVERY),
    ("_use_weight_decay", _EVERY),
    ("_apply_weight_decay", _EVERY),
    ("_get_current_learning_rate", _EVERY),
    ("_iterations", _EVERY),
    ("_all_reduce_sum_gradients", _EVERY),  # TensorFlow backend
    ("_get_variable_index", _MOMENTUM + _WRAPPER_BASE),
    ("_variables", _WRAPPER_BASE),
    ("_trainable_variables", _WRAPPER_BASE),
    ("_check_variables_are_known", _WRAPPER_BASE),
    # `accum._families` tells a Keras 3 optimizer by its base class (not exported as such
    # where `keras` is tf_keras under another name)
    ("Optimizer", ("keras.src.optimizers.optimizer",)),
    # `accum.local_gradients` (JAX): the mask Keras's losses read; the trainer's metrics update
    ("get_keras_mask", ("keras.src.backend",)),
    ("JAXTrainer._update_metrics_variables", ("keras.src.backend.jax.trainer",)),
    ("_momentums", _ADAM),
    ("_velocities", _ADAM),
    # replaced on a model instance (`accum._shadow.replace_methods`): `compile` by
    # `accum._recompile`, the train step by `accum.keras3._local_jax`
    ("Model.compile", ("keras",)),
    ("Model.train_step", ("keras",)),
    ("Model.make_train_function", ("keras",)),
    ("Model.fit", ("keras",)),
    ("Model.train_on_batch", ("keras",)),
)


def var_key(optimizer, variable):
    return optimizer._var_key(variable)


def var_keys(optimizer, variables):
    """`var_key` of each of `variables`, in order."""
    return [optimizer._var_key(v) for v in variables]


def uses_weight_decay(optimizer, variable):
    return optimizer._use_weight_decay(variable)


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


def has_momentum(optimizer):
    return bool(getattr(optimizer, "momentum", 0))


def slots(optimizer, variable):
    if isinstance(optimizer, keras.optimizers.SGD):
        return (optimizer.momentums[variable_index(optimizer, variable)],)
    if isinstance(optimizer, (keras.optimizers.Adam, keras.optimizers.AdamW)):
        i = variable_index(optimizer, variable)
        return (optimizer._momentums[i], optimizer._velocities[i])
    return None


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


def build(optimizer, variables):
    optimizer.build(variables)


# The wrapper's own base-class state (`_WRAPPER_BASE`).


def own_variables(optimizer):
    """The list of `optimizer`'s own variables (the base class's; appended to in place)."""
    return optimizer._variables


def own_iterations(optimizer):
    """`optimizer`'s own step counter, the variable behind `iterations`."""
    return optimizer._iterations


def own_trainable_variables(optimizer):
    """The model variables `optimizer` was built on, in its order."""
    return optimizer._trainable_variables


def variable_index(optimizer, variable):
    """The index of `variable` among those `optimizer` was built on."""
    return optimizer._get_variable_index(variable)


def variable_indices(optimizer, variables, known=None):
    """The indices of `variables` among those `optimizer` was built on, after a ValueError
    unless it was built on each of `known` (if given)."""
    if known is not None:
        optimizer._check_variables_are_known(known)
    return tuple(optimizer._get_variable_index(v) for v in variables)


def optimizer_base_class():
    """Keras 3's `Optimizer` base class, every backend's optimizers' (`accum._families`)."""
    from keras.src.optimizers.optimizer import Optimizer

    return Optimizer


def keras_mask(tensor):
    """The Keras mask attached to `tensor` (Keras's losses read it), or None."""
    from keras.src import backend

    return backend.get_keras_mask(tensor)


def update_metrics_variables(model, *args):
    """The JAX trainer's `_update_metrics_variables(metrics, loss, x, y, y_pred,
    sample_weight)` of `model`: `(logs, metrics)`."""
    return model._update_metrics_variables(*args)
