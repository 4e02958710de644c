"""The module layout of `recompute` (and the folder sizes of both libraries): no folder of
the library holds more than 10 files, no import cycle between `recompute`'s modules, and
its packages stand on floors -- `adapters` at the bottom, then `engine`, `ops`,
`policies` -- each importing only from the floors below it (and the top folder's leaf
modules `_errors`, `_scoped` and `_setting`)."""

import os

import pytest

import accum
import recompute
from tests.helpers import layout

LEAVES = {"_errors", "_scoped", "_setting"}  # top-folder modules that import nothing of recompute
FLOORS = ["adapters", "engine", "ops", "policies"]  # bottom first


@pytest.mark.parametrize("package", [recompute, accum], ids=["recompute", "accum"])
def test_no_folder_over_ten_files(package):
    crowded = {}
    for root, dirs, files in os.walk(os.path.dirname(package.__file__)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if len(files) > 10:
            crowded[root] = len(files)
    assert crowded == {}


def test_no_import_cycle():
    graph = layout.imports(recompute)
    graph = {m: {t for t in targets if t} for m, targets in graph.items() if m}
    assert layout.cyclic(graph) == []


def test_packages_stand_on_floors():
    graph = layout.imports(recompute)
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
    graph = layout.imports(recompute)
    inside = sorted(f"{module} -> {target}" for module, targets in graph.items()
                    if module.split(".")[0] in ("bert4keras", "keras_hub")
                    for target in targets if target in ("engine._core", "engine._jax", "engine._running"))
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


def test_one_tracker_for_both_engines():
    """Either engine's running call is seen by `inside_recomputed_call()` and by the unit check
    (`recomputes()`); TensorFlow's `kept` computes plainly under a call that keeps nothing."""
    import keras

    from recompute import engine
    from recompute.engine import _running

    layer = keras.layers.Dense(2)
    with _running.calls.entered(_running.RunningCall(layer)):
        assert engine.inside_recomputed_call() is True
        assert engine.of(_backends_adapter(layer)).recomputes() is False
        assert engine.kept(lambda: 3) == 3
    assert engine.inside_recomputed_call() is False


def _backends_adapter(layer):
    from recompute.adapters import _backends

    return _backends.adapter_for(layer)
