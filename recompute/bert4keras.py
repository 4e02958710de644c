"""bert4keras integration: its layers marked for recomputation use `recompute_grad`.

bert4keras (0.11.5, on tf_keras) marks the `call` of its attention,
feed-forward, layer-norm and a few other layers with its own
`@recompute_grad`, which fails on TensorFlow 2.21 (`tape.stop_recording` is
gone) and, once shimmed, gives wrong gradients (the self-attention input is
watched three times). After `patch()`, those layers recompute with this
package's exact decorator whenever `RECOMPUTE` is on (read when the layer runs,
like everywhere in this package):

```python
import recompute.bert4keras
recompute.bert4keras.patch()          # before building models; any import order

from bert4keras.models import build_transformer_model
model = build_transformer_model(config_path, checkpoint_path)
```

bert4keras needs `TF_KERAS=1 TF_USE_LEGACY_KERAS=1` in the environment and is
installed with `pip install --no-deps bert4keras==0.11.5` (it pins an ancient
Keras). Which layers are patched is read from bert4keras's own source: every
class of `bert4keras.layers` whose `call` is decorated with `@recompute_grad`.

`patch()` is idempotent and `unpatch()` undoes it. If `bert4keras.layers` is
not imported yet, `patch()` installs an import hook (a `sys.meta_path` finder,
removed by `unpatch()`) that patches the module right after it loads; nothing
else in the process changes.
"""

import importlib.abc
import inspect
import sys

from ._decorator import recompute_grad

MODULE = "bert4keras.layers"

_replaced = {}  # class -> the `call` it had before `patch()`
_hook = None


def _undecorated(fn):
    """The function bert4keras's `recompute_grad` wrapped, or `fn` if it returned it as is."""
    code = getattr(fn, "__code__", None)
    if code is not None and fn.__closure__ and "call" in code.co_freevars:
        if fn.__module__ == "bert4keras.backend":
            return fn.__closure__[code.co_freevars.index("call")].cell_contents
    return fn


def _is_marked(fn):
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return source.lstrip().startswith("@recompute_grad")


def marked_classes(module):
    """The classes of `module` whose `call` bert4keras decorates with `@recompute_grad`."""
    found = []
    for obj in vars(module).values():
        if isinstance(obj, type) and obj.__module__ == module.__name__ and "call" in obj.__dict__:
            if _is_marked(_undecorated(obj.__dict__["call"])):
                found.append(obj)
    return found


def _patch_module(module):
    for cls in marked_classes(module):
        if cls in _replaced:
            continue
        current = cls.__dict__["call"]
        _replaced[cls] = current
        cls.call = recompute_grad(_undecorated(current))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: patches `bert4keras.layers` as soon as it has been executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _hook is not None:
            _patch_module(module)


def patch():
    """Makes bert4keras's recomputed layers use `recompute_grad` (idempotent).

    Models must be built after the call (existing layer instances are patched
    too, since the methods are replaced on the classes). Turn recomputation on
    with `RECOMPUTE=1` or `recompute.recompute_scope(True)`.
    """
    global _hook
    module = sys.modules.get(MODULE)
    if module is not None:
        _patch_module(module)
    elif _hook is None:
        _hook = _PatchOnImport()
        sys.meta_path.insert(0, _hook)


def unpatch():
    """Restores bert4keras's own `call` methods and removes the import hook (idempotent)."""
    global _hook
    if _hook is not None:
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
    for cls, original in list(_replaced.items()):
        cls.call = original
        del _replaced[cls]


def is_patched():
    """True if `patch()` is in effect (classes patched or the import hook waiting)."""
    return bool(_replaced) or _hook is not None
