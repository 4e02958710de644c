"""Shadowing an object's attributes for a while: the one way `accum` changes a method of an
instance it does not own (the wrapped optimizer's, while its update is traced).

`shadowed(obj, {name: value})` sets the instance attributes, and restores on exit what
was there before (an instance attribute's old value, or nothing, so the class's method
shows again). Re-entrant per name: under a strategy each replica enters with the same
values, and the first to enter installs them, the last to leave restores; a name shadowed
inside another shadow of other names of the same object is independent of it. Set with
`object.__setattr__`, past a tracking `__setattr__` (Keras's, tf_keras's), so nothing is
tracked or saved.
"""

import contextlib

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
