"""`accum.BatchNormalization` for tf_keras: see `accum._batchnorm_window`."""

import types

import tensorflow as tf
import tf_keras

from . import _distributed
from ._batchnorm_window import TF_KERAS, BatchNormalization

_OPS = types.SimpleNamespace(
    sum=lambda x, axis: tf.reduce_sum(x, axis), square=tf.square, where=tf.where, cast=tf.cast,
    maximum=tf.maximum, reshape=tf.reshape, zeros_like=tf.zeros_like, ones_like=tf.ones_like,
    logical_and=tf.logical_and, convert=tf.convert_to_tensor, float32=tf.float32,
)


@tf_keras.saving.register_keras_serializable(package="accum", name="BatchNormalization")
class TFKerasBatchNormalization(BatchNormalization, tf_keras.layers.BatchNormalization):
    """`accum.BatchNormalization` for tf_keras; see there."""

    _FAMILY = TF_KERAS
    _ops = _OPS

    def __init__(self, *args, family=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_window_arguments()

    @staticmethod
    def _value(variable):
        return tf.convert_to_tensor(variable)

    def build(self, input_shape):
        super().build(input_shape)

        def add_weight(name, shape):
            return self.add_weight(
                name=name, shape=shape, dtype=tf.float32, initializer="zeros", trainable=False,
                experimental_autocast=False,
            )

        self._build_window_state(self.moving_mean.shape, add_weight, _distributed.replica_local_variables)

    def call(self, inputs, training=None, mask=None):
        if training is None:
            training = tf_keras.backend.learning_phase()
        if isinstance(training, (bool, int)) and not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if not self.trainable:
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
        old = [tf.identity(self.moving_mean), tf.identity(self.moving_variance)]
        outputs = super().call(inputs, training=training, mask=mask)
        with tf.control_dependencies([outputs]):
            for variable, value in zip((self.moving_mean, self.moving_variance), old):
                variable.assign(tf.where(on, value, tf.convert_to_tensor(variable)))
        if tf.executing_eagerly():
            self._accum_plain_steps = self._accum_plain_steps or not bool(self.accum_linked > 0)
        return outputs
