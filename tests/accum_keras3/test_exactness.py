"""Keras 3: AccumOptimizer(opt, k) at batch b equals opt at batch k*b, weights and slots."""

import keras
import numpy as np
import pytest

from tests.helpers import k3_reference
from tests.helpers.accum_family_checks import floatx, keras3_family  # noqa: F401 (fixtures)
from tests.helpers.accum_runs import accumulated_and_big_batch, check_k1_is_the_inner_optimizer
from tests.helpers.k3_optimizers import OPTIMIZERS, schedule
from tests.helpers.k3_reference import make_model, slot_values
from tests.helpers.numerics import assert_grouped_close

K, B, UPDATES = 4, 3, 6
TOL = {"float32": 1e-6, "float64": 1e-12}


def slot_kind(name):
    """Group for the comparison floor: "weights", or the slot's kind ("momentum", ...)."""
    return name.rsplit("_", 1)[-1] if ":" in name else "weights"


def compare(make_inner, dtype, k=K, compile=None, updates=UPDATES):
    model, opt, ref_model, ref_opt = accumulated_and_big_batch(k3_reference, make_inner, dtype, k, B, updates, compile)
    ref_slots, slots = slot_values(ref_opt), slot_values(opt.inner_optimizer)
    assert [n.split(":", 1)[1] for n in ref_slots] == [n.split(":", 1)[1] for n in slots]
    names = [w.path for w in model.weights] + list(slots)
    assert_grouped_close(
        ref_model.get_weights() + list(ref_slots.values()),
        model.get_weights() + list(slots.values()),
        TOL[dtype],
        names,
        slot_kind,
        floor_fraction=1.0,
    )
    # Training moved the weights: the comparison is not between two untouched models.
    assert not np.allclose(make_model(dtype).get_weights()[2], model.get_weights()[2])


# Centered RMSprop divides by sqrt(v - m^2), which amplifies the float32 rounding
# of the gradient mean (k sums of b vs one sum of k*b) to ~1e-6: its exactness
# is checked in float64 below.
@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"rmsprop_momentum_centered"}))
def test_matches_big_batch_float32(name, floatx):
    compare(OPTIMIZERS[name], floatx("float32"))


@pytest.mark.parametrize("name", ["sgd_nesterov", "adam_schedule_clipnorm", "adamw", "rmsprop_momentum_centered", "adam_ema"])
def test_matches_big_batch_float64(name, floatx):
    compare(OPTIMIZERS[name], floatx("float64"))


@pytest.mark.parametrize("compile", ["function", "jit"])
@pytest.mark.parametrize("name", ["adam_schedule_clipnorm", "sgd_momentum"])
def test_matches_big_batch_compiled(name, compile, floatx):
    compare(OPTIMIZERS[name], floatx("float32"), compile=compile)


def test_k1_is_the_inner_optimizer(floatx):
    """k=1: bit-identical to the inner optimizer at the same batch."""
    floatx("float32")
    check_k1_is_the_inner_optimizer(k3_reference, keras.optimizers.Adam(schedule(), clipnorm=0.1, weight_decay=0.01), B)
