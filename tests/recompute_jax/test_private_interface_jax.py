"""Keras 3 on JAX: every private Keras name that `recompute.engine._jax` relies on -- listed in
the `PRIVATE_NAMES` of `recompute.adapters._keras_private` and `recompute.adapters._mha_private` -- and the
JAX and Keras names `recompute._xla_plan` reads exist on the installed versions (tests/helpers/private_names_checks.py; the TensorFlow-backend
suite checks the same lists, with TensorFlow's, in tests/recompute_keras3)."""

from recompute.adapters import _keras_private, _mha_private

from recompute import _xla_plan
from tests.helpers.private_names_checks import assert_listed_names_exist
from tests.recompute_keras3.test_private_interface import keras3_made


def test_keras_private_names_exist():
    assert_listed_names_exist(_keras_private, keras3_made())


def test_mha_private_names_exist():
    assert_listed_names_exist(_mha_private, keras3_made(), owners=lambda path: path.startswith("keras."))


def test_xla_plan_private_names_exist():
    assert_listed_names_exist(_xla_plan)
