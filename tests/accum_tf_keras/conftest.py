"""Fixtures for the tf_keras accum tests (the two logical CPUs are set up in tests/conftest.py):
`family` (tf_keras), `legacy` (new-style and legacy optimizers) and `floatx`, from
tests/helpers/accum_family_checks.py."""

from tests.helpers.accum_family_checks import floatx, new_style_and_legacy, tf_keras_family  # noqa: F401
