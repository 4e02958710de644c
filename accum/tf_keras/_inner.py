"""`accum._inner.InnerApi` for tf_keras new-style optimizers (`tf_keras.optimizers.*`).

The only place in `accum` where private names of a wrapped tf_keras new-style
optimizer (and of tf_keras's `LossScaleOptimizer`, also for legacy ones) are
touched (`PRIVATE_NAMES`; tests/accum_tf_keras/test_inner_interface_tf_keras.py
checks them against the installed tf_keras). tf_keras has no public slot
accessors for these optimizers, nor a public current learning rate under a
schedule; it is frozen at 2.x, so these names are stable.
"""

import contextlib

import tensorflow as tf

from .. import _families

name = _families.TF_KERAS
UPDATE_STEPS = ("_update_step", "_update_step_xla")
WEIGHT_DECAY = "_apply_weight_decay"

_EVERY = tuple(
    f"tf_keras.optimizers.{cls}"
    for cls in ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta",
                "Adafactor", "Ftrl", "Lion")
)
_MOMENTUM = ("tf_keras.optimizers.SGD", "tf_keras.optimizers.Adam", "tf_keras.optimizers.AdamW")
_ADAM = _MOMENTUM[1:]
# The loss-scale state's names, for `LossScaleOptimizer`s around a new-style or a legacy optimizer.
LOSS_SCALE_NAMES = ("_loss_scale.current_loss_scale", "_loss_scale.counter")
# The wrapper's own base class, `tf_keras.optimizers.Optimizer` (as SGD has it): the state the
# wrapper (`accum.tf_keras._optimizer`, `accum.tf_keras._rescale_step`) keeps in it, and the method it
# overrides (`_create_iteration_variable`: named there, it cannot go through a function).
_WRAPPER_BASE = ("tf_keras.optimizers.SGD",)

PRIVATE_NAMES = (
    ("_update_step", _EVERY),
    ("_update_step_xla", _EVERY),
    ("_var_key", _EVERY),
    ("_use_weight_decay", _EVERY),
    ("_apply_weight_decay", _EVERY),
    ("_compute_current_learning_rate", _EVERY),
    ("_learning_rate", _EVERY),
    ("_iterations", _EVERY),
    ("_index_dict", _MOMENTUM),
    ("_momentums", _ADAM),
    ("_velocities", _ADAM),
    ("_variables", _WRAPPER_BASE),
    ("_built", _WRAPPER_BASE),
    ("_index_dict", _WRAPPER_BASE),
    ("_no_dependency", _WRAPPER_BASE),
    ("_create_iteration_variable", _WRAPPER_BASE),
    # set on the optimizer a `LossScaleOptimizer` wraps (`accum.modes._distributed`)
    ("inner_optimizer._is_wrapped_by_loss_scale_optimizer",
     ("tf_keras.mixed_precision.LossScaleOptimizer",)),
    # the overridden updates of the moving statistics (`accum.tf_keras._batchnorm`)
    ("BatchNormalization._assign_moving_average", ("tf_keras.layers",)),
    ("BatchNormalization._assign_new_value", ("tf_keras.layers",)),
    # replaced on a model instance by `accum._recompile` (`accum._shadow.replace_methods`)
    ("Model.compile", ("tf_keras",)),
) + tuple((attribute, ("tf_keras.mixed_precision.LossScaleOptimizer",)) for attribute in LOSS_SCALE_NAMES)


def var_key(optimizer, variable):
    return optimizer._var_key(variable)


def uses_weight_decay(optimizer, variable):
    return optimizer._use_weight_decay(variable)


def apply_weight_decay(optimizer, variables):
    # The decay reads `_current_learning_rate` under a schedule: updated first, as
    # `apply_gradients` does.
    optimizer._compute_current_learning_rate()
    optimizer._apply_weight_decay(variables)


def has_momentum(optimizer):
    return bool(getattr(optimizer, "momentum", 0))


def slots(optimizer, variable):
    import tf_keras

    new = tf_keras.optimizers
    if isinstance(optimizer, new.SGD):
        return (optimizer.momentums[optimizer._index_dict[optimizer._var_key(variable)]],)
    if isinstance(optimizer, (new.Adam, new.AdamW)):
        i = optimizer._index_dict[optimizer._var_key(variable)]
        return (optimizer._momentums[i], optimizer._velocities[i])
    return None


def current_learning_rate(optimizer, dtype=None):
    # Updates `_current_learning_rate` under a schedule, as `apply_gradients` does.
    optimizer._compute_current_learning_rate()
    learning_rate = optimizer.learning_rate
    return learning_rate if dtype is None else tf.cast(learning_rate, dtype)


def step_hooks(optimizer, iterations, learning_rate):
    return {
        "_iterations": iterations,
        "_compute_current_learning_rate": lambda: None,
        "_learning_rate": learning_rate,
        WEIGHT_DECAY: lambda variables: None,
    }


def skip_all_reduce(optimizer):
    # `apply_gradients(..., skip_gradients_aggregation=True)` skips it.
    return contextlib.nullcontext()


def loss_scale(optimizer):
    # tf_keras exposes the current scale only as a tensor (`loss_scale`); the
    # variables live in the optimizer's `_loss_scale` state object.
    if getattr(optimizer, "dynamic", False) and hasattr(optimizer, "get_unscaled_gradients"):
        state = optimizer._loss_scale
        return state.current_loss_scale, state.counter
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


def set_own_iterations(optimizer, variable):
    optimizer._iterations = variable


def mark_built(optimizer):
    """Tells the base class that `optimizer` is built."""
    optimizer._built = True


def own_index(optimizer):
    """`optimizer`'s map of a variable's key (`var_key`) to its index."""
    return optimizer._index_dict


def untracked(optimizer, value):
    """`value`, assigned to an attribute of `optimizer` without being tracked as a dependency."""
    return optimizer._no_dependency(value)


def wrapped_by_loss_scale_optimizer(optimizer):
    """True if a `LossScaleOptimizer` wraps `optimizer` (it aggregates the gradients itself)."""
    return getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", False)
