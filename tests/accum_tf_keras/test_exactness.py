"""tf_keras (new-style and legacy): AccumOptimizer(opt, k) at batch b equals opt at batch k*b."""

import numpy as np
import pytest
import tf_keras as K

from tests.helpers import tfk_reference
from tests.helpers.accum_runs import accumulated_and_big_batch, check_k1_is_the_inner_optimizer
from tests.helpers.numerics import assert_grouped_close
from tests.helpers.tfk_reference import make_model, optimizer_variables

KK, B, UPDATES = 4, 3, 6
TOL = {"float32": 1e-6, "float64": 1e-12}
O, L = K.optimizers, K.optimizers.legacy


def schedule():
    return O.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)


NEW = {
    "sgd": lambda: O.SGD(0.1),
    "sgd_momentum": lambda: O.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
    "sgd_schedule_wd": lambda: O.SGD(schedule(), momentum=0.5, weight_decay=0.1),
    "adam": lambda: O.Adam(0.01),
    "adam_schedule_clipnorm": lambda: O.Adam(schedule(), clipnorm=0.05),
    "adam_global_clipnorm": lambda: O.Adam(0.01, global_clipnorm=0.05),
    "adam_clipvalue_amsgrad": lambda: O.Adam(0.01, clipvalue=0.01, amsgrad=True),
    "adamw": lambda: O.AdamW(0.01, weight_decay=0.05),
    "adamw_schedule": lambda: O.AdamW(schedule(), weight_decay=0.05),
    "rmsprop_momentum": lambda: O.RMSprop(0.01, momentum=0.5),
    "adam_ema": lambda: O.Adam(0.01, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=4),
}
LEGACY = {
    "legacy_sgd": lambda: L.SGD(0.1),
    "legacy_sgd_nesterov": lambda: L.SGD(0.05, momentum=0.9, nesterov=True),
    "legacy_adam": lambda: L.Adam(0.01),
    "legacy_adam_schedule_clipnorm": lambda: L.Adam(schedule(), clipnorm=0.05),
    "legacy_adam_global_clipnorm_amsgrad": lambda: L.Adam(0.01, global_clipnorm=0.05, amsgrad=True),
    "legacy_rmsprop_momentum": lambda: L.RMSprop(0.01, momentum=0.5),
    "legacy_rmsprop_momentum_clipvalue": lambda: L.RMSprop(0.01, momentum=0.5, clipvalue=0.01),
    "legacy_adam_clipvalue": lambda: L.Adam(0.01, clipvalue=0.01),
    "legacy_adagrad": lambda: L.Adagrad(0.05),
}
ALL = {**NEW, **LEGACY}


SLOT_NAMES = {"m", "v", "vhat", "momentum", "velocity", "velocity_hat", "rms", "mg", "accumulator",
              "average", "iteration", "iter", "learning_rate", "current_learning_rate"}


def slot_kind(name):
    """Comparison group: "weights", or the slot's name (new: "m/var:0", legacy: "var/m:0")."""
    if not name[0].isdigit():
        return "weights"
    parts = name.split(":", 1)[1].rsplit(":", 1)[0].split("/")
    for part in (parts[0], parts[-1]):
        if part in SLOT_NAMES:
            return part
    return "other"


def compare(make_inner, dtype, compile=None, k=KK):
    model, opt, ref_model, ref_opt = accumulated_and_big_batch(tfk_reference, make_inner, dtype, k, B, UPDATES, compile)
    inner = opt.inner_optimizer
    ref_vars, got_vars = optimizer_variables(ref_opt), optimizer_variables(inner)
    assert [v.shape for v in ref_vars] == [v.shape for v in got_vars]
    names = [w.name for w in model.weights] + [f"{i}:{v.name}" for i, v in enumerate(got_vars)]
    assert_grouped_close(
        ref_model.get_weights() + [v.numpy() for v in ref_vars],
        model.get_weights() + [v.numpy() for v in got_vars],
        TOL[dtype],
        names,
        slot_kind,
        floor_fraction=1.0,
    )
    assert not np.allclose(make_model(dtype).get_weights()[2], model.get_weights()[2])


# RMSprop with clipvalue amplifies the float32 rounding of the gradient mean
# (k sums of b vs one sum of k*b) to a few 1e-6 in its slots: checked in float64.
@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(set(ALL) - {"legacy_rmsprop_momentum_clipvalue"}))
def test_matches_big_batch_float32(name, floatx):
    compare(ALL[name], floatx("float32"))


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw_schedule", "adam_ema", "legacy_adam_schedule_clipnorm",
                                  "legacy_rmsprop_momentum_clipvalue"])
def test_matches_big_batch_float64(name, floatx):
    compare(ALL[name], floatx("float64"))


@pytest.mark.parametrize("name", ["adam_schedule_clipnorm", "legacy_adam_schedule_clipnorm"])
def test_matches_big_batch_in_tf_function(name, floatx):
    compare(ALL[name], floatx("float32"), compile="function")


@pytest.mark.parametrize("name", ["adam_schedule_clipnorm", "legacy_sgd_nesterov"])
def test_k1_is_the_inner_optimizer(name, floatx):
    floatx("float32")
    check_k1_is_the_inner_optimizer(tfk_reference, ALL[name](), B)
