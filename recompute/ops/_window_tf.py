"""Dropout on TensorFlow inside a cut of the batch: the whole batch's random numbers, drawn for
the cut's samples only (`windowed_draws`: Keras 3's here, tf_keras's in
`recompute.adapters._tf_keras`).

Where a recomputed call runs its batch in cuts (`recompute.engine._cuts_tf`), each cut is
the call on some of the batch's samples, and each of its `Dropout` layers must drop what the
layer drops for those samples in the uncut call. Keras draws `tf.random.stateless_uniform` of
the input's shape (`keras.random.dropout`, through `tf.nn.experimental.stateless_dropout`):
Philox numbers counted from the seed's counter in the tensor's flat order, 4 per step of
the counter (2 in float64), on TensorFlow's kernels and in XLA alike. So the numbers of the
samples `[start, start + size)` are those drawn from the counter advanced by `start`'s
first element over 4 (`window_uniform`): no whole batch drawn in each cut.

`windowed_dropouts(layers)` shadows, while active, the call of each plain `Dropout` among
`layers` (`_lean.plain_dropout`: the family's own class, no noise shape): inside a cut
(`recompute.engine._running.batch_window()`) it draws so, and drops with
`tf.nn.experimental.general_dropout` (TensorFlow's dropout with a given sampler, the
formula of `stateless_dropout`); elsewhere it is the layer's call.

`decided_once(layers)` shadows the dropout of Keras's own attention core under `"full"`:
its decision drawn once a step, in the forward pass, as bits kept for the recomputation
(`recompute.engine._core.kept`), where Keras's dropout would draw it again there.
"""

import tensorflow as tf

from ..adapters import _tf
from ..engine import _core, _running
from . import _flash_tf, _lean
from .._scoped import shadowed


def window_uniform(seed, shape, dtype, window):
    """`tf.random.stateless_uniform((window.batch,) + shape[1:], seed, dtype=dtype)`'s samples
    `[window.start, window.start + shape[0])`, drawing only those
    (`recompute.adapters._tf.uniform_window`). `seed`: int32 [2]; `shape`: the cut's static
    shape; `window.start` may be a tensor."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return _tf.uniform_window(key, counter, shape, dtype, window)


def _windowed(layer, own_call):
    def call(inputs, training=False):
        window = _running.batch_window()
        if window is None or not training or not 0 < layer.rate < 1:
            return own_call(inputs, training=training)
        numbers = window_uniform(_flash_tf.keras_seed(layer), inputs.shape, inputs.dtype,
                                 window)
        return tf.nn.experimental.general_dropout(
            inputs, layer.rate, uniform_sampler=lambda shape, dtype: numbers)

    return call


def windowed_dropouts(layers):
    """While active, the plain `Dropout` layers among `layers` draw a cut's numbers
    inside a cut (the module's docstring); restored on exit."""
    return shadowed((layer, "call", _windowed(layer, layer.call))
                    for layer in layers if _lean.plain_dropout(layer))


def windowed_draws(adapter, layers):
    """While active, inside a cut of the batch (`recompute.engine._running.batch_window()`),
    the random draws of `layers` (a call's sublayers, of `adapter`'s family) are the whole
    batch's for the cut's samples: on Keras 3 its plain `Dropout` layers'
    (`windowed_dropouts`), on tf_keras every draw of a `RandomGenerator`
    (`recompute.adapters._tf_keras.windowed_draws`; a draw that cannot be so makes the call
    run whole)."""
    if adapter.name == "tf_keras":
        return adapter.windowed_draws(_running.batch_window())
    return windowed_dropouts(layers)


def _decided_once(layer, own_call):
    def call(inputs, training=False):
        if (not training or not 0 < layer.rate < 1 or not isinstance(inputs, tf.Tensor)
                or inputs.dtype != tf.float32 or None in inputs.shape[1:]):
            return own_call(inputs, training=training)

        def decide():  # in chunks; else (a cut not on a step of the counter) the layer's own
            bits = _flash_tf.dropout_bits(layer, inputs, inputs.shape[1:].as_list(),
                                          "float32", None)
            if bits is None:
                bits = _flash_tf.pack(own_call(tf.ones_like(inputs), training=True) != 0)
            return bits

        # unpacked once the input exists: else an executor unpacks every block's bits at once,
        # early (whole batches, BERT-base: 128.8 against 96.8 MiB per sample)
        bits = _core.after([_core.kept(decide)], inputs)[0]
        keep = _flash_tf.ENGINE.unpack(bits, inputs.shape[-1])
        scale = tf.constant(1 / (1 - layer.rate), inputs.dtype)
        return tf.where(keep, inputs * scale, tf.zeros([], inputs.dtype))

    call.decided_once = True
    return call


def decided_once(layers):
    """While active, each plain Keras 3 `Dropout` among `layers` (Keras's own attention core's,
    under `"full"`) keeps its decision in float32 training as bits across the passes of the
    recomputation (`recompute.engine._core.kept`): drawn once a step, in the forward pass
    (`_flash_tf.dropout_bits`, its own numbers in chunks), and applied from the bits in both,
    `where(keep, x * scale, 0)` as TensorFlow's dropout; elsewhere the layer's call. Restored
    on exit. A call shadowed already by `windowed_dropouts` is the one run elsewhere (the
    bits are drawn for the cut's rows anyway)."""
    import keras

    return shadowed((layer, "call", _decided_once(layer, layer.call)) for layer in layers
                    if type(layer) is keras.layers.Dropout and layer.noise_shape is None
                    and not getattr(vars(layer).get("call"), "decided_once", False))
