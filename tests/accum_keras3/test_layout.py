"""The module layout of `accum`: no import cycle (the shared base imports no family
implementation), and the optimizer argument is checked once per construction."""

import keras
import pytest

import accum
from accum import AccumOptimizer
from tests.helpers import layout

FAMILIES = {"keras3._optimizer", "keras3._jax", "tf_keras._optimizer", "tf_keras._legacy"}


def test_no_import_cycle():
    graph = layout.imports(accum, inits=False)
    assert layout.cyclic(graph) == []
    assert not layout.reachable(graph, "_base") & FAMILIES


def test_optimizer_checked_once(monkeypatch):
    from accum import _base

    calls = []
    check = _base.check_optimizer

    def counting(optimizer):
        calls.append(optimizer)
        return check(optimizer)

    monkeypatch.setattr(_base, "check_optimizer", counting)
    # Where a family module holds its own reference (older layouts), count that too.
    monkeypatch.setattr("accum.keras3._optimizer.check_optimizer", counting, raising=False)
    inner = keras.optimizers.SGD()
    AccumOptimizer(inner, 2)
    assert len(calls) == 1
    from accum.keras3._optimizer import Keras3AccumOptimizer

    calls.clear()
    Keras3AccumOptimizer(keras.optimizers.SGD(), 2)
    assert len(calls) == 1


def test_family_class_refuses_other_family():
    from accum.keras3._optimizer import Keras3AccumOptimizer

    class NotAnOptimizer:
        pass

    with pytest.raises(ValueError, match=r"must be a Keras 3 or tf_keras optimizer instance"):
        Keras3AccumOptimizer(NotAnOptimizer(), 2)
