"""Every private name an interface module lists in its `PRIVATE_NAMES` exists on the
installed versions.

The format is `accum._inner`'s: pairs `(attribute, owners)`, an attribute (a dotted path
for an attribute of an attribute) that each owner must have. An owner is named by a
string: the import path of a module (the attribute is the module's), of a class (an
instance of it where the test passes a factory for that owner in `made`, else the class
itself), or a description of an object the test makes (a factory in `made`). Each
family's test module (tests/recompute_keras3/test_private_interface.py,
tests/recompute_tf_keras/test_private_interface_tf_keras.py,
tests/recompute_jax/test_private_interface_jax.py) calls `assert_listed_names_exist`
with the owners it can make, so a Keras or TensorFlow upgrade that renames one fails
there, naming it.
"""

import importlib

_MISSING = object()


def well_formed(module):
    """The entries of `module.PRIVATE_NAMES` that are not `(str, (str, ...))`."""
    return [
        entry for entry in module.PRIVATE_NAMES
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], tuple) and entry[1]
                and all(isinstance(o, str) for o in entry[1]))
    ]


def owner(path, made=None):
    """The object `path` names (see the module's docstring)."""
    made = made or {}
    if path in made:
        return made[path]()
    try:
        return importlib.import_module(path)
    except ImportError:
        pass
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def missing_names(module, made=None, owners=None):
    """`"owner: attribute"` for each name of `module.PRIVATE_NAMES` that its owner lacks
    (only the owners for which `owners(path)` is true, if given)."""
    missing = []
    resolved = {}
    for attribute, paths in module.PRIVATE_NAMES:
        for path in paths:
            if owners is not None and not owners(path):
                continue
            if path not in resolved:
                resolved[path] = owner(path, made)
            target = resolved[path]
            for part in attribute.split("."):
                target = getattr(target, part, _MISSING)
                if target is _MISSING:
                    missing.append(f"{path}: {attribute}")
                    break
    return missing


def assert_listed_names_exist(module, made=None, owners=None):
    assert not well_formed(module), f"{module.__name__}.PRIVATE_NAMES: malformed {well_formed(module)}"
    missing = missing_names(module, made, owners)
    assert not missing, (
        f"{module.__name__}.PRIVATE_NAMES not found on the installed versions: {missing}")
