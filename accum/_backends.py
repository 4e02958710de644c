"""The backend split: which Keras an optimizer belongs to, and the class that wraps it.

| family            | optimizers                                  | implementation          |
| ----------------- | ------------------------------------------- | ----------------------- |
| `KERAS3`          | `keras.optimizers.*` (TensorFlow backend)    | `_keras3`               |
| `TF_KERAS`        | `tf_keras.optimizers.*` (new-style)          | `_tf_keras`             |
| `TF_KERAS_LEGACY` | `tf_keras.optimizers.legacy.*` (OptimizerV2) | `_tf_keras_legacy`      |

Detection goes by the optimizer's class hierarchy. tf_keras is imported only
when the optimizer comes from it, so a Keras 3 program never loads it (and
bert4keras-style code that replaces `sys.modules["keras"]` with tf_keras is
still told apart by the class's module, `tf_keras.src...`).
"""

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
