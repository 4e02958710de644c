"""The dispatch, above the three family implementations: the class that wraps an optimizer.

`accum._base` (the shared base, `AccumOptimizer`) imports no implementation;
this module imports them (lazily: tf_keras is loaded only when needed). It changes
nothing when imported: `accum/__init__` links it to the public classes (`link`) and
registers the implementations for loading (`register_serializable_classes`).

| family            | implementation                                    |
| ----------------- | ------------------------------------------------- |
| `KERAS3`          | `accum.keras3._optimizer.Keras3AccumOptimizer`    |
| `KERAS3`, JAX     | `accum.keras3._jax.JaxAccumOptimizer`             |
| `TF_KERAS`        | `accum.tf_keras._optimizer.TFKerasAccumOptimizer` |
| `TF_KERAS_LEGACY` | `accum.tf_keras._legacy.LegacyAccumOptimizer`     |
"""

import importlib.util
import os
import sys

from ._families import KERAS3, TF_KERAS, TF_KERAS_LEGACY


def implementation_for(family):
    """Returns the `AccumOptimizer` subclass that wraps optimizers of `family`."""
    if family == KERAS3:
        if _keras3_backend() == "jax":
            from .keras3._jax import JaxAccumOptimizer

            return JaxAccumOptimizer
        from .keras3._optimizer import Keras3AccumOptimizer

        return Keras3AccumOptimizer
    if family == TF_KERAS:
        from .tf_keras._optimizer import TFKerasAccumOptimizer

        return TFKerasAccumOptimizer
    if family == TF_KERAS_LEGACY:
        from .tf_keras._legacy import LegacyAccumOptimizer

        return LegacyAccumOptimizer
    raise ValueError(f"Unknown optimizer family: {family!r}")


def _keras3_backend():
    import keras

    return keras.backend.backend()


def implementation_class(cls):
    """The class `cls` (an implementation, named by a saved config) resolves to on this
    Keras 3 backend: a model saved on one backend loads on the other."""
    if getattr(cls, "_FAMILY", None) == KERAS3:
        return implementation_for(KERAS3)
    return cls


def register_serializable_classes():
    """Registers the implementations with Keras's serialization (called by `import accum`).

    Saved models name the class `accum>AccumOptimizer` (Keras 3, tf_keras) or
    `accum>LegacyAccumOptimizer` (tf_keras legacy), and the layer
    `accum>BatchNormalization`, which `load_model` looks
    up in the Keras registry; the registering decorators run when the
    implementation modules are imported. The Keras 3 class is registered if
    Keras 3 is installed and `keras` is not replaced by another module. The
    tf_keras classes are registered if tf_keras is already imported or
    `TF_USE_LEGACY_KERAS` is set (`tf.keras` is then tf_keras): a Keras 3
    program does not load tf_keras. So a tf_keras program imports tf_keras
    before `accum` (or sets `TF_USE_LEGACY_KERAS=1`) to load `.h5` files;
    tf_keras's `.keras` loading imports the module the file names by itself.
    """
    keras = sys.modules.get("keras")
    if keras is None and importlib.util.find_spec("keras") is not None:
        import keras
    version = getattr(keras, "__version__", "0") if getattr(keras, "__name__", None) == "keras" else "0"
    if int(version.split(".")[0]) >= 3:
        from .keras3 import _batchnorm, _optimizer  # noqa: F401

        if keras.backend.backend() == "jax":
            from .keras3 import _jax  # noqa: F401  (the same registered name, on JAX)

    # The values TensorFlow's lazy loader reads as "tf.keras is tf_keras"
    # (recompute.bert4keras reads them the same way).
    legacy_keras = os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")
    if "tf_keras" in sys.modules or (legacy_keras and importlib.util.find_spec("tf_keras") is not None):
        from .tf_keras import _batchnorm, _legacy, _optimizer  # noqa: F401


def batch_normalization_class(family):
    """The `accum.BatchNormalization` class of a family (`"keras3"` or `"tf_keras"`)."""
    if family == "tf_keras":
        from .tf_keras._batchnorm import TFKerasBatchNormalization

        return TFKerasBatchNormalization
    from .keras3._batchnorm import Keras3BatchNormalization

    return Keras3BatchNormalization


def link(accum_optimizer, batch_normalization):
    """Gives the public classes (`accum.AccumOptimizer`, `accum.BatchNormalization`) their
    dispatch (called by `import accum`): they live below the implementations, which import
    them, so they cannot import this module."""
    accum_optimizer._implementation_for = staticmethod(implementation_for)
    accum_optimizer._implementation_class = staticmethod(implementation_class)
    batch_normalization._implementation_for = staticmethod(batch_normalization_class)
