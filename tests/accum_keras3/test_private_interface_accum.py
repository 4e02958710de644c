"""Every private name `accum._callers` (the call-stack lookups of `accum`) and
`accum._families` (Keras 3's optimizer base class) rely on -- listed in their
`PRIVATE_NAMES` -- exists on the running Python (tests/helpers/private_names_checks.py),
and the lookups find what they are for."""

import sys

from accum import _callers, _families
from tests.helpers.private_names_checks import assert_listed_names_exist


def test_callers_private_names_exist():
    assert_listed_names_exist(_callers, {"a frame": lambda: sys._getframe(0)})


def test_families_private_names_exist():
    assert_listed_names_exist(_families)


class _Model:
    layers = ()

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def fit(self):
        return _callers.model_calling(self.optimizer)

    def train_step(self):
        return _callers.self_running(_Model.train_step.__code__)


def test_model_calling_finds_the_model_whose_method_runs():
    optimizer = object()
    model = _Model(optimizer)
    assert model.fit() is model
    assert _callers.model_calling(optimizer) is None


def test_self_running_finds_the_innermost_call_of_the_code():
    model = _Model(None)
    assert model.train_step() is model
    assert _callers.self_running(_Model.train_step.__code__) is None


def test_caller_imports_names_the_calling_module_s_modules():
    assert "sys" in _callers.caller_imports(("accum",), depth=0)
