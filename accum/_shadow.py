"""Changing a method of an instance `accum` does not own, in one place: for a while (the
wrapped optimizer's, while its update is traced: `shadowed`), or until taken back (a
model's `compile` and train step: `replace_methods`, `restore_methods`).

`shadowed(obj, {name: value})` sets the instance attributes, and restores on exit what
was there before (an instance attribute's old value, or nothing, so the class's method
shows again). Re-entrant per name: under a strategy each replica enters with the same
values, and the first to enter installs them, the last to leave restores; a name shadowed
inside another shadow of other names of the same object is independent of it. Set with
`object.__setattr__`, past a tracking `__setattr__` (Keras's, tf_keras's), so nothing is
tracked or saved.
"""

import contextlib
import types

_MISSING = object()
_SHADOWS = "_accum_shadows"  # on the object: name -> [depth, the value shadowed]


@contextlib.contextmanager
def shadowed(obj, attributes):
    """Sets `attributes` ({name: value}) on `obj` inside, restoring what was there on exit."""
    shadows = obj.__dict__.get(_SHADOWS)
    if shadows is None:
        shadows = {}
        object.__setattr__(obj, _SHADOWS, shadows)
    for name, value in attributes.items():
        if name in shadows:
            shadows[name][0] += 1
            continue
        shadows[name] = [1, obj.__dict__.get(name, _MISSING)]
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for name in attributes:
            entry = shadows[name]
            entry[0] -= 1
            if entry[0]:
                continue
            del shadows[name]
            if entry[1] is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, entry[1])
        if not shadows:
            object.__delattr__(obj, _SHADOWS)


def replace_methods(obj, functions):
    """Binds `functions` ({name: function(self, ...)}) to `obj` as instance methods, in place
    of its class's, until `restore_methods` (for as long as a model is so trained, not for
    a block)."""
    for name, function in functions.items():
        object.__setattr__(obj, name, types.MethodType(function, obj))


def restore_methods(obj, names):
    """Removes the instance methods `names` that `replace_methods` bound (those present), so
    the class's show again. True if one was removed."""
    present = [name for name in names if name in vars(obj)]
    for name in present:
        object.__delattr__(obj, name)
    return bool(present)
