"""The module layout of `recompute` (and the folder sizes of both libraries): no folder of
the library holds more than 10 files, no import cycle between `recompute`'s modules, and
its packages stand on floors -- `adapters` at the bottom, then `engine`, `ops`,
`policies` -- each importing only from the floors below it (and the top folder's leaf
modules `_errors`, `_scoped` and `_setting`)."""

import ast
import os

import pytest

import accum
import recompute

LEAVES = {"_errors", "_scoped", "_setting"}  # top-folder modules that import nothing of recompute
FLOORS = ["adapters", "engine", "ops", "policies"]  # bottom first


def _modules(package):
    """dotted module name below `package` (its `__init__` as the package's own name) ->
    (the package it sits in, its path)."""
    folder = os.path.dirname(package.__file__)
    modules = {}
    for root, _, files in os.walk(folder):
        inner = os.path.relpath(root, folder).replace(os.sep, ".")
        inner = "" if inner == "." else inner
        for file in files:
            if not file.endswith(".py"):
                continue
            stem = file[:-3]
            name = inner if stem == "__init__" else (f"{inner}.{stem}" if inner else stem)
            modules[name] = (inner, os.path.join(root, file))
    return modules


def _imports(package):
    """module -> the modules of `package` it imports (at any level, lazily too)."""
    modules = _modules(package)

    def resolve(inner, level, module):
        parts = inner.split(".") if inner else []
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    graph = {}
    for name, (inner, path) in modules.items():
        names = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = resolve(inner, node.level, node.module)
                for alias in node.names:
                    target = f"{base}.{alias.name}" if base else alias.name
                    names.add(target if target in modules else base)
        graph[name] = names - {name}
    return graph


@pytest.mark.parametrize("package", [recompute, accum], ids=["recompute", "accum"])
def test_no_folder_over_ten_files(package):
    crowded = {}
    for root, dirs, files in os.walk(os.path.dirname(package.__file__)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if len(files) > 10:
            crowded[root] = len(files)
    assert crowded == {}


def test_no_import_cycle():
    graph = _imports(recompute)
    graph = {m: {t for t in targets if t} for m, targets in graph.items() if m}

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for name in graph.get(todo.pop(), ()):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return seen

    assert sorted(m for m in graph if m in reachable(m)) == []


def test_packages_stand_on_floors():
    graph = _imports(recompute)
    wrong = []
    for module, targets in graph.items():
        floor = module.split(".")[0]
        if floor not in FLOORS:
            continue
        below = set(FLOORS[: FLOORS.index(floor) + 1])
        for target in targets:
            top = target.split(".")[0]
            if top not in below and target not in LEAVES:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_integrations_use_the_engine_interface():
    """bert4keras's and keras-hub's integrations reach the engines through `recompute.engine`
    (its `of`, `kept`, `after`, ...), never through an engine's own module."""
    graph = _imports(recompute)
    inside = sorted(f"{module} -> {target}" for module, targets in graph.items()
                    if module.split(".")[0] in ("bert4keras", "keras_hub")
                    for target in targets if target in ("engine._core", "engine._jax"))
    assert inside == []


def test_engine_interface():
    import keras

    from recompute import engine
    from recompute.adapters import _backends

    layer = keras.layers.Dense(2)
    chosen = engine.of(_backends.adapter_for(layer))
    assert chosen.name == keras.backend.backend()
    assert isinstance(chosen, engine.Engine)
    assert chosen.recomputes() is False  # no tape records here
    assert engine.inside_recomputed_call() is False
