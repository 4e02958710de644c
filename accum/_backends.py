"""The backend split: which Keras an optimizer belongs to, and the class that wraps it.

| family            | optimizers                                  | implementation          |
| ----------------- | ------------------------------------------- | ----------------------- |
| `KERAS3`          | `keras.optimizers.*` (TensorFlow backend)    | `_keras3`               |
| `TF_KERAS`        | `tf_keras.optimizers.*` (new-style)          | `_tf_keras`             |
| `TF_KERAS_LEGACY` | `tf_keras.optimizers.legacy.*` (OptimizerV2) | `_tf_keras_legacy`      |

Detection goes by the optimizer's class hierarchy. tf_keras is imported only
when the optimizer comes from it or the program already uses tf_keras (see
`register_serializable_classes`), so a Keras 3 program never loads it (and
bert4keras-style code that replaces `sys.modules["keras"]` with tf_keras is
still told apart by the class's module, `tf_keras.src...`).
"""

import importlib.util
import os
import sys

KERAS3 = "keras3"
TF_KERAS = "tf_keras"
TF_KERAS_LEGACY = "tf_keras.legacy"


def family_of(optimizer):
    """Returns `KERAS3`, `TF_KERAS`, `TF_KERAS_LEGACY`, or None if `optimizer` is no optimizer."""
    roots = {cls.__module__.split(".")[0] for cls in type(optimizer).__mro__}
    if "keras" in roots:
        from keras.src.optimizers.optimizer import Optimizer

        if isinstance(optimizer, Optimizer):
            return KERAS3
    if "tf_keras" in roots:
        import tf_keras

        if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
            return TF_KERAS_LEGACY
        if isinstance(optimizer, tf_keras.optimizers.Optimizer):
            return TF_KERAS
    return None


def implementation_for(family):
    """Returns the `AccumOptimizer` subclass that wraps optimizers of `family`."""
    if family == KERAS3:
        from ._keras3 import Keras3AccumOptimizer

        return Keras3AccumOptimizer
    if family == TF_KERAS:
        from ._tf_keras import TFKerasAccumOptimizer

        return TFKerasAccumOptimizer
    if family == TF_KERAS_LEGACY:
        from ._tf_keras_legacy import LegacyAccumOptimizer

        return LegacyAccumOptimizer
    raise ValueError(f"Unknown optimizer family: {family!r}")


def register_serializable_classes():
    """Registers the implementations with Keras's serialization (called by `import accum`).

    Saved models name the class `accum>AccumOptimizer` (Keras 3, tf_keras) or
    `accum>LegacyAccumOptimizer` (tf_keras legacy), which `load_model` looks
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
        from . import _keras3  # noqa: F401

    legacy_keras = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    if "tf_keras" in sys.modules or (legacy_keras and importlib.util.find_spec("tf_keras") is not None):
        from . import _tf_keras, _tf_keras_legacy  # noqa: F401
