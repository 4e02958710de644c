"""`mode="momentum"` for Keras 3: access to the slots of `keras.optimizers.SGD`, `Adam` and `AdamW`
(through `accum.keras3._inner`)."""

import keras
import tensorflow as tf

from ..modes import _momentum
from . import _inner


class _Keras3Slots(_momentum.SlotAdapter):
    """The `MomentumRule` adapter for a built Keras 3 optimizer."""

    def __init__(self, optimizer, kind):
        super().__init__(optimizer, kind)
        if kind == _momentum.SGD:
            self.hyper = {"momentum": optimizer.momentum}
        else:
            self.hyper = {
                "beta_1": optimizer.beta_1,
                "beta_2": optimizer.beta_2,
                "epsilon": optimizer.epsilon,
            }

    def slots(self, variable):
        return tuple(None if s is None else s.value for s in _inner.slots(self.optimizer, variable))

    def learning_rate(self, dtype):
        return tf.cast(self.optimizer.learning_rate, dtype)

    def apply_weight_decay(self, variables):
        _inner.apply_weight_decay(self.optimizer, variables)


def rule_for(optimizer):
    """The `MomentumRule` for a Keras 3 optimizer, or a Keras-style `ValueError`."""
    _momentum.check_common(optimizer)
    if type(optimizer) is keras.optimizers.SGD:
        if not _inner.has_momentum(optimizer):
            raise _momentum.unsupported(optimizer, "`momentum=0` has no moment slot")
        if optimizer.nesterov:
            raise _momentum.unsupported(optimizer, "`nesterov=True` needs the old momentum at the end")
        kind = _momentum.SGD
    elif type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW):
        if optimizer.amsgrad:
            raise _momentum.unsupported(optimizer, "`amsgrad=True`")
        kind = _momentum.ADAM
    else:
        raise _momentum.unsupported(optimizer, "it is not SGD, Adam or AdamW")
    return _momentum.MomentumRule(kind, _Keras3Slots(optimizer, kind))
