"""`mode="momentum"` for tf_keras: slot access for SGD, Adam and AdamW (new-style) and legacy SGD/Adam.

tf_keras has no public slot accessors for new-style optimizers (`momentums`,
`_momentums`, `_velocities` are attributes of the optimizer classes), nor a
public current learning rate under a schedule; tf_keras is frozen at 2.x, so
these attributes are stable. Legacy optimizers have `get_slot`.
"""

import tensorflow as tf
import tf_keras

from . import _momentum


class _NewStyleSlots(_momentum.SlotAdapter):
    """The `MomentumRule` adapter for a built `tf_keras.optimizers.*` optimizer."""

    @property
    def hyper(self):
        opt = self.optimizer
        if self.kind == _momentum.SGD:
            return {"momentum": opt.momentum}
        return {"beta_1": opt.beta_1, "beta_2": opt.beta_2, "epsilon": opt.epsilon}

    def slots(self, variable):
        opt = self.optimizer
        i = opt._index_dict[opt._var_key(variable)]
        if self.kind == _momentum.SGD:
            return (opt.momentums[i],)
        return (opt._momentums[i], opt._velocities[i])

    def learning_rate(self, dtype):
        # Updates `_current_learning_rate` under a schedule, as `apply_gradients` does.
        self.optimizer._compute_current_learning_rate()
        return tf.cast(self.optimizer.learning_rate, dtype)

    def apply_weight_decay(self, variables):
        self.optimizer._compute_current_learning_rate()
        self.optimizer._apply_weight_decay(variables)


class _LegacySlots(_momentum.SlotAdapter):
    """The `MomentumRule` adapter for a built `tf_keras.optimizers.legacy.*` optimizer."""

    @property
    def hyper(self):
        opt = self.optimizer
        if self.kind == _momentum.SGD:
            return {"momentum": opt._get_hyper("momentum")}
        return {
            "beta_1": opt._get_hyper("beta_1"),
            "beta_2": opt._get_hyper("beta_2"),
            "epsilon": opt.epsilon,
        }

    def slots(self, variable):
        names = ("momentum",) if self.kind == _momentum.SGD else ("m", "v")
        return tuple(self.optimizer.get_slot(variable, name) for name in names)

    def learning_rate(self, dtype):
        return self.optimizer._decayed_lr(dtype)

    def apply_weight_decay(self, variables):
        pass  # legacy optimizers have no decoupled weight decay


def rule_for(optimizer):
    """The `MomentumRule` for a tf_keras optimizer, or a Keras-style `ValueError`."""
    _momentum.check_common(optimizer)
    new, legacy = tf_keras.optimizers, tf_keras.optimizers.legacy
    if type(optimizer) in (new.SGD, legacy.SGD):
        momentum = optimizer.momentum if type(optimizer) is new.SGD else optimizer._momentum
        if not momentum:
            raise _momentum.unsupported(optimizer, "`momentum=0` has no moment slot")
        if optimizer.nesterov:
            raise _momentum.unsupported(optimizer, "`nesterov=True` needs the old momentum at the end")
        kind = _momentum.SGD
    elif type(optimizer) in (new.Adam, new.AdamW, legacy.Adam):
        if optimizer.amsgrad:
            raise _momentum.unsupported(optimizer, "`amsgrad=True`")
        kind = _momentum.ADAM
    else:
        raise _momentum.unsupported(optimizer, "it is not SGD, Adam or AdamW")
    adapter = _LegacySlots if isinstance(optimizer, legacy.Optimizer) else _NewStyleSlots
    return _momentum.MomentumRule(kind, adapter(optimizer, kind))
