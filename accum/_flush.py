"""The flush callback: applies a partial window at the end of each epoch or of training."""

from . import _families

_AT = ("epoch_end", "train_end")


def _callback_base(family):
    if family == _families.KERAS3:
        import keras

        return keras.callbacks.Callback
    import tf_keras

    return tf_keras.callbacks.Callback


def make_flush_callback(optimizer, at="epoch_end"):
    """Returns a `Callback` (of `optimizer`'s Keras) that calls `optimizer.flush()` at `at`."""
    if at not in _AT:
        raise ValueError(
            f"`at` must be one of {', '.join(repr(a) for a in _AT)}. Received: at={at!r}"
        )
    base = _callback_base(_families.family_of(optimizer))

    class AccumFlushCallback(base):
        """Calls `AccumOptimizer.flush()` at every epoch end or at train end."""

        def __init__(self):
            super().__init__()
            self.optimizer = optimizer
            self.at = at

        def on_epoch_end(self, epoch, logs=None):
            if self.at == "epoch_end":
                self.optimizer.flush()

        def on_train_end(self, logs=None):
            self.optimizer.flush()

    return AccumFlushCallback()
