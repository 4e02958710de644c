"""The module layout of `accum`: no import cycle (the shared base imports no family
implementation), and the optimizer argument is checked once per construction."""

import ast
import os

import keras
import pytest

import accum
from accum import AccumOptimizer

FAMILIES = {"_keras3", "_tf_keras", "_tf_keras_legacy"}


def _imports():
    """accum module -> the accum modules it imports (at any level, lazily too)."""
    folder = os.path.dirname(accum.__file__)
    graph = {}
    for file in os.listdir(folder):
        if not file.endswith(".py") or file == "__init__.py":
            continue
        tree = ast.parse(open(os.path.join(folder, file)).read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    names.add(node.module.split(".")[0])
                else:
                    names.update(alias.name for alias in node.names)
        graph[file[:-3]] = names
    return graph


def test_no_import_cycle():
    graph = _imports()

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for name in graph.get(todo.pop(), ()):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return seen

    cycles = sorted(m for m in graph if m in reachable(m))
    assert cycles == []
    assert not reachable("_base") & FAMILIES


def test_optimizer_checked_once(monkeypatch):
    from accum import _base

    calls = []
    check = _base.check_optimizer

    def counting(optimizer):
        calls.append(optimizer)
        return check(optimizer)

    monkeypatch.setattr(_base, "check_optimizer", counting)
    # Where a family module holds its own reference (older layouts), count that too.
    monkeypatch.setattr("accum._keras3.check_optimizer", counting, raising=False)
    inner = keras.optimizers.SGD()
    AccumOptimizer(inner, 2)
    assert len(calls) == 1
    from accum._keras3 import Keras3AccumOptimizer

    calls.clear()
    Keras3AccumOptimizer(keras.optimizers.SGD(), 2)
    assert len(calls) == 1


def test_family_class_refuses_other_family():
    from accum._keras3 import Keras3AccumOptimizer

    class NotAnOptimizer:
        pass

    with pytest.raises(ValueError, match=r"must be a Keras 3 or tf_keras optimizer instance"):
        Keras3AccumOptimizer(NotAnOptimizer(), 2)
