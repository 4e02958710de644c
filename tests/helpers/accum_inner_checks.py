"""Every family module of `accum._inner` implements the whole `InnerApi`, and every
private name it relies on exists on the installed optimizers it is used with.

Written once; each suite's test module imports the checks with the fixture `api` of
its family (its own pytest process): tests/accum_keras3/test_inner_interface.py
(`keras3_apis`), tests/accum_tf_keras/test_inner_interface_tf_keras.py
(`tf_keras_apis`: new-style and legacy). A Keras upgrade that renames a private name
fails `test_private_names_exist_on_the_installed_optimizers`, naming it.
"""

import importlib

import numpy as np
import pytest

from accum import _families, _inner
from tests.helpers import protocol_checks

__all__ = [
    "test_every_member_is_defined",
    "test_signatures_match_the_protocol",
    "test_no_member_is_a_placeholder",
    "test_constants_have_the_protocol_types",
    "test_private_names_exist_on_the_installed_optimizers",
]


@pytest.fixture(name="api", params=["keras3._inner"], ids=str)
def keras3_apis(request):
    """Keras 3's module (TensorFlow backend)."""
    return importlib.import_module(f"accum.{request.param}")


@pytest.fixture(name="api", params=["tf_keras._inner", "tf_keras._inner_legacy"], ids=str)
def tf_keras_apis(request):
    """tf_keras's modules: new-style and legacy optimizers."""
    return importlib.import_module(f"accum.{request.param}")


def test_every_member_is_defined(api):
    missing = protocol_checks.missing_members(api, _inner.MEMBERS)
    assert not missing, f"{api.__name__} lacks {missing}"


def test_signatures_match_the_protocol(api):
    mismatched = protocol_checks.mismatched_signatures(api, _inner.InnerApi, _inner.MEMBERS)
    assert not mismatched, mismatched


def test_no_member_is_a_placeholder(api):
    # A member that does not apply to a family says so through a value (None, False,
    # a context that does nothing), never by raising.
    found = protocol_checks.placeholders(
        api, _inner.MEMBERS, ("AssertionError", "NotImplementedError"))
    assert not found, found


def test_constants_have_the_protocol_types(api):
    assert api.name in (_families.KERAS3, _families.TF_KERAS, _families.TF_KERAS_LEGACY)
    assert api.UPDATE_STEPS and all(isinstance(n, str) for n in api.UPDATE_STEPS)
    assert api.WEIGHT_DECAY is None or isinstance(api.WEIGHT_DECAY, str)
    for attribute, owners in api.PRIVATE_NAMES:
        assert isinstance(attribute, str) and owners and all(isinstance(o, str) for o in owners)


def test_private_names_exist_on_the_installed_optimizers(api):
    missing = []
    for attribute, owners in api.PRIVATE_NAMES:
        for owner in owners:
            target = _owner(api, owner)
            for part in attribute.split("."):
                target = getattr(target, part, _MISSING)
                if target is _MISSING:
                    missing.append(f"{owner}: {attribute}")
                    break
    assert not missing, f"{api.__name__}.PRIVATE_NAMES not found on the installed optimizers: {missing}"


_MISSING = object()


def _owner(api, path):
    """The module at `path`, or an instance of the optimizer class at `path`, built on one
    variable (a `LossScaleOptimizer` around the family's SGD)."""
    try:
        return importlib.import_module(path)
    except ImportError:
        pass
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type), path
    variable, sgd, build = _family(api.name)
    optimizer = cls(sgd()) if "LossScaleOptimizer" in name else cls()
    build(optimizer, variable)
    return optimizer


def _family(family):
    """(a variable, the family's SGD class, build(optimizer, variable))."""
    import tensorflow as tf

    if family == _families.KERAS3:
        import keras

        return keras.Variable(np.ones(2, "float32")), keras.optimizers.SGD, lambda o, v: o.build([v])
    import tf_keras

    variable = tf.Variable(np.ones(2, "float32"))
    if family == _families.TF_KERAS:
        return variable, tf_keras.optimizers.SGD, lambda o, v: o.build([v])
    # OptimizerV2 has no public `build`: one step creates the slots.
    return variable, tf_keras.optimizers.legacy.SGD, lambda o, v: o.apply_gradients([(tf.ones(2), v)])

