"""`mode="momentum"` for tf_keras: SGD, Adam and AdamW (new-style) and legacy SGD/Adam.

The slots, the current learning rate and the weight decay are asked of the
family's `accum._inner` module (`accum.tf_keras._inner`, `accum.tf_keras._inner_legacy`):
new-style optimizers have no public slot accessors nor a public current
learning rate under a schedule; legacy ones have `get_slot` and no decoupled
weight decay.
"""

import tf_keras

from ..modes import _momentum
from . import _inner, _inner_legacy


class _Slots(_momentum.SlotAdapter):
    """The `MomentumRule` adapter for a built tf_keras optimizer, new-style or legacy
    (`api`: its `accum._inner.InnerApi`)."""

    def __init__(self, optimizer, kind, api):
        super().__init__(optimizer, kind)
        self.api = api

    @property
    def hyper(self):
        # Read at each use (a legacy optimizer's hyperparameters are variables once created).
        opt = self.optimizer
        if self.kind == _momentum.SGD:
            return {"momentum": opt.momentum}
        return {"beta_1": opt.beta_1, "beta_2": opt.beta_2, "epsilon": opt.epsilon}

    def slots(self, variable):
        return self.api.slots(self.optimizer, variable)

    def learning_rate(self, dtype):
        return self.api.current_learning_rate(self.optimizer, dtype)

    def apply_weight_decay(self, variables):
        self.api.apply_weight_decay(self.optimizer, variables)


def rule_for(optimizer):
    """The `MomentumRule` for a tf_keras optimizer, or a Keras-style `ValueError`."""
    _momentum.check_common(optimizer)
    new, legacy = tf_keras.optimizers, tf_keras.optimizers.legacy
    api = _inner_legacy if isinstance(optimizer, legacy.Optimizer) else _inner
    if type(optimizer) in (new.SGD, legacy.SGD):
        if not api.has_momentum(optimizer):
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
    return _momentum.MomentumRule(kind, _Slots(optimizer, kind, api))
