"""`accum._inner.InnerApi` for tf_keras legacy optimizers (`tf_keras.optimizers.legacy.*`, OptimizerV2).

The only place in `accum` where private names of a wrapped legacy optimizer
are touched (`PRIVATE_NAMES`; tests/accum_tf_keras/test_inner_interface_tf_keras.py
checks them against the installed tf_keras). Legacy optimizers have no
decoupled weight decay and apply fused kernels: `uses_weight_decay` is False,
`WEIGHT_DECAY` and `step_hooks` are None. One more function, for the legacy
wrapper only: `compute_gradients`.
"""

import contextlib

import tensorflow as tf

from .. import _families
from .._inner import owned_by, reader
from ._inner import LOSS_SCALE_NAMES, loss_scale  # noqa: F401 (the same LossScaleOptimizer)

name = _families.TF_KERAS_LEGACY
UPDATE_STEPS = ("_resource_apply_dense",)  # the window's means are dense
WEIGHT_DECAY = None

_OPTIMIZER_V2 = "tf_keras.src.optimizers.legacy.optimizer_v2"
_EVERY = tuple(
    f"tf_keras.optimizers.legacy.{cls}"
    for cls in ("SGD", "Adam", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl")
)
_SGD, _ADAM = "tf_keras.optimizers.legacy.SGD", "tf_keras.optimizers.legacy.Adam"

PRIVATE_NAMES = (
    owned_by((_OPTIMIZER_V2,), "_var_key")  # a function of the module
    + owned_by(_EVERY, "_resource_apply_dense", "_create_all_weights", "_compute_gradients")
    + owned_by((_SGD, "tf_keras.optimizers.legacy.RMSprop"), "_momentum")
    + owned_by((_SGD, _ADAM), "_decayed_lr")
    # The wrapper's own base class, `OptimizerV2` (as SGD has it): its state, and the method
    # the wrapper overrides (`_aggregate_gradients`: named there, it cannot go through a function)
    + owned_by((_SGD,), "_track_trackable", "_weights", "_name", "_aggregate_gradients")
    + owned_by(("tf_keras.mixed_precision.LossScaleOptimizer",), *LOSS_SCALE_NAMES)
)


def var_key(optimizer, variable):
    from tf_keras.src.optimizers.legacy.optimizer_v2 import _var_key

    return _var_key(variable)


def uses_weight_decay(optimizer, variable):
    return False


def apply_weight_decay(optimizer, variables):
    return None  # no decoupled weight decay


def has_momentum(optimizer):
    # `momentum` reads the hyperparameter (a tensor once created); the flag says whether
    # the optimizer keeps the slot.
    return bool(getattr(optimizer, "_momentum", False))


def slots(optimizer, variable):
    import tf_keras

    legacy = tf_keras.optimizers.legacy
    if isinstance(optimizer, legacy.SGD):
        return (optimizer.get_slot(variable, "momentum"),)
    if isinstance(optimizer, legacy.Adam):
        return (optimizer.get_slot(variable, "m"), optimizer.get_slot(variable, "v"))
    return None


def current_learning_rate(optimizer, dtype=None):
    return optimizer._decayed_lr(tf.float32 if dtype is None else dtype)


def step_hooks(optimizer, iterations, learning_rate):
    return None  # fused kernels: the update cannot be steered


def skip_all_reduce(optimizer):
    # `apply_gradients(..., experimental_aggregate_gradients=False)` skips it.
    return contextlib.nullcontext()


def build(optimizer, variables):
    # OptimizerV2 has no public `build`; this is what its `apply_gradients` calls
    # first (slots of new variables only).
    optimizer._create_all_weights(variables)


def compute_gradients(optimizer, loss, variables, grad_loss=None, tape=None):
    """The legacy wrapper's `_compute_gradients`: `optimizer`'s (a `LossScaleOptimizer`
    scales the loss and unscales the gradients)."""
    return optimizer._compute_gradients(loss, variables, grad_loss=grad_loss, tape=tape)


# The wrapper's own base-class state (`OptimizerV2`'s).


def track(optimizer, trackable, name):
    """Makes `trackable` a checkpoint dependency of `optimizer` under `name`."""
    optimizer._track_trackable(trackable, name=name)


own_weights = reader("_weights", "`optimizer`'s own variables (the base class's list).")
own_name = reader("_name", "The name `optimizer` was given (the base class keeps it).")
