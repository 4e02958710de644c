"""`accum.BatchNormalization` for Keras 3 (TensorFlow backend): see `accum.batchnorm._layer`."""

import types

import keras
from keras import ops as kops

from ..batchnorm._layer import KERAS3, BatchNormalization

_OPS = types.SimpleNamespace(
    sum=kops.sum, square=kops.square, where=kops.where, cast=kops.cast, maximum=kops.maximum,
    reshape=kops.reshape, zeros_like=kops.zeros_like, ones_like=kops.ones_like,
    logical_and=kops.logical_and, convert=kops.convert_to_tensor, float32="float32",
)


@keras.saving.register_keras_serializable(package="accum", name="BatchNormalization")
class Keras3BatchNormalization(BatchNormalization, keras.layers.BatchNormalization):
    """`accum.BatchNormalization` for Keras 3; see there."""

    _FAMILY = KERAS3
    _ops = _OPS
    _WINDOW_WEIGHT = dict(initializer="zeros", trainable=False, dtype="float32", autocast=False)

    @staticmethod
    def _value(variable):
        return variable.value

    @staticmethod
    def _train_step_code():
        return keras.Model.train_step.__code__

    def _link_for_training_call(self):
        if keras.backend.backend() != "tensorflow":
            # No `AccumOptimizer` links the layer on this backend (refused when built).
            return False
        return super()._link_for_training_call()

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or self._link_for_training_call() is False:
            return super().call(inputs, training=training, mask=mask)
        linked = self.accum_linked.value > 0
        x = kops.cast(inputs, "float32")
        weights = None
        if mask is not None:
            weights = kops.broadcast_to(kops.expand_dims(kops.cast(mask, "float32"), -1), kops.shape(x))
        shape = [1] * len(x.shape)
        shape[self.axis] = self.moving_mean.shape[0]
        self._accumulate(x, self._reduction_axes, shape, linked, weights)
        old = [kops.copy(v.value) for v in (self.moving_mean, self.moving_variance)]
        outputs = super().call(inputs, training=training, mask=mask)
        for variable, value in zip((self.moving_mean, self.moving_variance), old):
            variable.assign(kops.where(linked, value, variable.value))
        if not _in_traced_function():
            self._accum_plain_steps = self._accum_plain_steps or not bool(linked)
        return outputs


def _in_traced_function():
    import tensorflow as tf

    return not tf.executing_eagerly()
