"""`accum.BatchNormalization` for tf_keras: see `accum.batchnorm._layer`."""

import threading
import types

import tensorflow as tf
import tf_keras

from ..batchnorm._layer import TF_KERAS, BatchNormalization

_OPS = types.SimpleNamespace(
    sum=lambda x, axis: tf.reduce_sum(x, axis), square=tf.square, where=tf.where, cast=tf.cast,
    maximum=tf.maximum, reshape=tf.reshape, zeros_like=tf.zeros_like, ones_like=tf.ones_like,
    logical_and=tf.logical_and, convert=tf.convert_to_tensor, float32=tf.float32,
)


# While a layer's `call` runs: id(layer) -> `on`. Thread-local: under a
# `MirroredStrategy` each replica runs `call` in its own thread.
_ON = threading.local()


def _on(layer):
    return getattr(_ON, "layers", {}).get(id(layer))


@tf_keras.saving.register_keras_serializable(package="accum", name="BatchNormalization")
class TFKerasBatchNormalization(BatchNormalization, tf_keras.layers.BatchNormalization):
    """`accum.BatchNormalization` for tf_keras; see there."""

    _FAMILY = TF_KERAS
    _ops = _OPS
    _WINDOW_WEIGHT = dict(dtype=tf.float32, initializer="zeros", trainable=False,
                          experimental_autocast=False)

    @staticmethod
    def _value(variable):
        # `read_value`: in the cross-replica context a replica-local sum is summed.
        return variable.read_value()

    @staticmethod
    def _train_step_code():
        return tf_keras.Model.train_step.__code__

    def _window_variance(self, variance, count):
        # The fused kernel (4-D inputs) moves the statistics with the unbiased variance.
        if self.fused:
            return variance * count / tf.maximum(count - 1.0, 1.0)
        return variance

    def call(self, inputs, training=None, mask=None):
        if training is None:
            training = tf_keras.backend.learning_phase()
        if isinstance(training, (bool, int)) and not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if not self.trainable or self._link_for_training_call() is False:
            return super().call(inputs, training=training, mask=mask)
        on = tf.logical_and(tf.cast(training, tf.bool), self.accum_linked > 0)
        x = tf.cast(inputs, tf.float32)
        ndims = len(x.shape)
        axes = [a % ndims for a in self.axis]
        reduction = [i for i in range(ndims) if i not in axes]
        shape = [1] * ndims
        for a in axes:
            shape[a] = x.shape[a]
        self._accumulate(x, reduction, shape, on)
        # The layer's own per-batch update of the moving statistics keeps the old
        # values where `on` (`_assign_moving_average`, `_assign_new_value` below).
        active = _ON.__dict__.setdefault("layers", {})
        active[id(self)] = on
        try:
            outputs = super().call(inputs, training=training, mask=mask)
        finally:
            del active[id(self)]
        if tf.executing_eagerly():
            self._accum_plain_steps = self._accum_plain_steps or not bool(self.accum_linked > 0)
        return outputs

    def _assign_moving_average(self, variable, value, momentum, inputs_size):
        if _on(self) is not None:
            value = tf.where(_on(self), tf.cast(tf.convert_to_tensor(variable), value.dtype), value)
        return super()._assign_moving_average(variable, value, momentum, inputs_size)

    def _assign_new_value(self, variable, value):
        if _on(self) is not None:
            value = tf.where(_on(self), tf.cast(tf.convert_to_tensor(variable), value.dtype), value)
        return super()._assign_new_value(variable, value)
