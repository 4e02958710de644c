"""The module layout of `accum`: no import cycle (the shared base imports no family
implementation), and the optimizer argument is checked once per construction."""

import ast
import os

import keras
import pytest

import accum
from accum import AccumOptimizer

FAMILIES = {"keras3._optimizer", "keras3._jax", "tf_keras._optimizer", "tf_keras._legacy"}


def _imports():
    """accum module (dotted, below `accum`) -> the accum modules it imports (at any
    level, lazily too); package `__init__` files are left out."""
    folder = os.path.dirname(accum.__file__)
    modules = {}
    for root, _, files in os.walk(folder):
        package = os.path.relpath(root, folder).replace(os.sep, ".")
        package = "" if package == "." else package
        for file in files:
            if file.endswith(".py") and file != "__init__.py":
                name = f"{package}.{file[:-3]}" if package else file[:-3]
                modules[name] = (package, os.path.join(root, file))

    def resolve(package, level, module):
        parts = package.split(".") if package else []
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    graph = {}
    for name, (package, path) in modules.items():
        tree = ast.parse(open(path).read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = resolve(package, node.level, node.module)
                for alias in node.names:
                    target = f"{base}.{alias.name}" if base else alias.name
                    names.add(target if target in modules else base)
        graph[name] = names
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
