"""`accum._inner.InnerApi` for Keras 3 optimizers (TensorFlow and JAX backends).

The only place in `accum` where private names of a wrapped Keras 3 optimizer
are touched (`PRIVATE_NAMES`; tests/accum_keras3/test_inner_interface.py
checks them against the installed Keras).
"""

import contextlib

import keras

from . import _families

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

PRIVATE_NAMES = (
    ("update_step", _EVERY),
    ("_var_key", _EVERY),
    ("_use_weight_decay", _EVERY),
    ("_apply_weight_decay", _EVERY),
    ("_get_current_learning_rate", _EVERY),
    ("_iterations", _EVERY),
    ("_all_reduce_sum_gradients", _EVERY),  # TensorFlow backend
    ("_get_variable_index", _MOMENTUM),
    ("_momentums", _ADAM),
    ("_velocities", _ADAM),
)


def var_key(optimizer, variable):
    return optimizer._var_key(variable)


def uses_weight_decay(optimizer, variable):
    return optimizer._use_weight_decay(variable)


def apply_weight_decay(optimizer, variables):
    optimizer._apply_weight_decay(variables)


def weight_decay_where(optimizer, variables, flag_of, learning_rate=None):
    """Keras 3's decoupled weight decay (`variable -= variable * weight_decay *
    learning_rate`, as `_apply_weight_decay`) as a select: applied to each variable it
    applies to where `flag_of(variable)` (a scalar bool, or None: always) holds.
    `learning_rate`: the optimizer's own if None. (Keras 3 only: the JAX masked update
    and `mode="rescale"`.)"""
    if optimizer.weight_decay is None:
        return
    for variable in variables:
        if uses_weight_decay(optimizer, variable):
            lr = keras.ops.cast(
                optimizer.learning_rate if learning_rate is None else learning_rate, variable.dtype)
            wd = keras.ops.cast(optimizer.weight_decay, variable.dtype)
            new = variable.value - variable.value * wd * lr
            flag = flag_of(variable)
            variable.assign(new if flag is None else keras.ops.where(flag, new, variable.value))


def has_momentum(optimizer):
    return bool(getattr(optimizer, "momentum", 0))


def slots(optimizer, variable):
    if isinstance(optimizer, keras.optimizers.SGD):
        return (optimizer.momentums[optimizer._get_variable_index(variable)],)
    if isinstance(optimizer, (keras.optimizers.Adam, keras.optimizers.AdamW)):
        i = optimizer._get_variable_index(variable)
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


@contextlib.contextmanager
def skip_all_reduce(optimizer):
    """Keras 3 optimizers all-reduce their gradients inside `apply` (TensorFlow backend,
    `_all_reduce_sum_gradients`) and take no argument to skip it: `optimizer`'s is
    replaced by the identity (`list`) on the instance while the update is traced."""
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", list)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "_all_reduce_sum_gradients")


def loss_scale(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale, optimizer.step_counter
    return None


def build(optimizer, variables):
    optimizer.build(variables)
