"""`accum._inner.InnerApi` for tf_keras new-style optimizers (`tf_keras.optimizers.*`).

The only place in `accum` where private names of a wrapped tf_keras new-style
optimizer (and of tf_keras's `LossScaleOptimizer`, also for legacy ones) are
touched, with the readers it shares with Keras 3 (`var_key`, `uses_weight_decay`,
`has_momentum`, `build`, `own_variables`, `own_iterations`, `accum._inner`) (`PRIVATE_NAMES`; tests/accum_tf_keras/test_inner_interface_tf_keras.py
checks them against the installed tf_keras). tf_keras has no public slot
accessors for these optimizers, nor a public current learning rate under a
schedule; it is frozen at 2.x, so these names are stable.
"""

import contextlib

import tensorflow as tf

from .. import _families
from .._inner import owned_by, reader, shared_private_names
from .._inner import (  # noqa: F401 (members of this family's interface)
    build, has_momentum, moment_slots, own_iterations, own_variables, uses_weight_decay, var_key)

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
    shared_private_names(_EVERY, _ADAM, _WRAPPER_BASE)
    + owned_by(_EVERY, "_update_step", "_update_step_xla", "_apply_weight_decay",
               "_compute_current_learning_rate", "_learning_rate", "_iterations")
    + owned_by(_MOMENTUM + _WRAPPER_BASE, "_index_dict")
    + owned_by(_WRAPPER_BASE, "_built", "_no_dependency", "_create_iteration_variable")
    # set on the optimizer a `LossScaleOptimizer` wraps (`accum.modes._distributed`)
    + owned_by(("tf_keras.mixed_precision.LossScaleOptimizer",),
               "inner_optimizer._is_wrapped_by_loss_scale_optimizer", *LOSS_SCALE_NAMES)
    # the overridden updates of the moving statistics (`accum.tf_keras._batchnorm`)
    + owned_by(("tf_keras.layers",), "BatchNormalization._assign_moving_average",
               "BatchNormalization._assign_new_value")
    # replaced on a model instance by `accum._recompile` (`accum._shadow.replace_methods`)
    + owned_by(("tf_keras",), "Model.compile")
)


def apply_weight_decay(optimizer, variables):
    # The decay reads `_current_learning_rate` under a schedule: updated first, as
    # `apply_gradients` does.
    optimizer._compute_current_learning_rate()
    optimizer._apply_weight_decay(variables)


def slots(optimizer, variable):
    import tf_keras

    new = tf_keras.optimizers
    return moment_slots(optimizer, variable, _index, new.SGD, (new.Adam, new.AdamW))


def _index(optimizer, variable):
    return optimizer._index_dict[optimizer._var_key(variable)]


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


# The wrapper's own base-class state (`_WRAPPER_BASE`).


def set_own_iterations(optimizer, variable):
    optimizer._iterations = variable


def mark_built(optimizer):
    """Tells the base class that `optimizer` is built."""
    optimizer._built = True


own_index = reader("_index_dict", "`optimizer`'s map of a variable's key (`var_key`) to its index.")


def untracked(optimizer, value):
    """`value`, assigned to an attribute of `optimizer` without being tracked as a dependency."""
    return optimizer._no_dependency(value)


def wrapped_by_loss_scale_optimizer(optimizer):
    """True if a `LossScaleOptimizer` wraps `optimizer` (it aggregates the gradients itself)."""
    return getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", False)
