"""The Keras families: which Keras an optimizer belongs to.

(A *family* is Keras 3, tf_keras or tf_keras legacy; a family is not a backend:
Keras 3's optimizers are one family on the TensorFlow and the JAX backends, whose
wrappers `accum._dispatch` picks by the backend: `accum.keras3._optimizer` or `accum.keras3._jax`.)
`accum._dispatch` maps a family to its implementation.

| family            | optimizers                                   |
| ----------------- | -------------------------------------------- |
| `KERAS3`          | `keras.optimizers.*` (TensorFlow or JAX)     |
| `TF_KERAS`        | `tf_keras.optimizers.*` (new-style)          |
| `TF_KERAS_LEGACY` | `tf_keras.optimizers.legacy.*` (OptimizerV2) |

Detection goes by the optimizer's class hierarchy. tf_keras is imported only
when the optimizer comes from it or the program already uses tf_keras (see
`accum._dispatch.register_serializable_classes`), so a Keras 3 program never
loads it (and bert4keras-style code that replaces `sys.modules["keras"]` with tf_keras is
still told apart by the class's module, `tf_keras.src...`).
"""

KERAS3 = "keras3"
TF_KERAS = "tf_keras"
TF_KERAS_LEGACY = "tf_keras.legacy"

# The private name `family_of` reads, in `accum._inner`'s format (checked against the
# installed Keras by tests/accum_keras3/test_private_interface_accum.py): Keras 3's
# optimizer base class, every backend's, by the module that defines it (not exported as
# such where `keras` is tf_keras under another name, as bert4keras makes it).
PRIVATE_NAMES = (("Optimizer", ("keras.src.optimizers.optimizer",)),)


def _keras3_optimizer_base():
    from keras.src.optimizers.optimizer import Optimizer

    return Optimizer


def family_of(optimizer):
    """Returns `KERAS3`, `TF_KERAS`, `TF_KERAS_LEGACY`, or None if `optimizer` is no optimizer."""
    roots = {cls.__module__.split(".")[0] for cls in type(optimizer).__mro__}
    if "keras" in roots:
        if isinstance(optimizer, _keras3_optimizer_base()):
            return KERAS3
    if "tf_keras" in roots:
        import tf_keras

        if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
            return TF_KERAS_LEGACY
        if isinstance(optimizer, tf_keras.optimizers.Optimizer):
            return TF_KERAS
    return None
