"""Fixtures for the tf_keras accum tests (the two logical CPUs are set up in tests/conftest.py)."""

import pytest
import tf_keras as K



@pytest.fixture
def floatx():
    """Sets tf_keras floatx for one test."""
    previous = K.backend.floatx()

    def set_to(dtype):
        K.backend.set_floatx(dtype)
        return dtype

    yield set_to
    K.backend.set_floatx(previous)
