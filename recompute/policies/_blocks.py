"""Which calls are blocks, both engines': `kept_block` (a Keras 3 block of Keras's attention,
`Dense`, `LayerNormalization` and `Dropout` layers, with no weights of its own: on JAX
`"attention"` runs it as one checkpoint keeping named values, `recompute.policies._jax`) and
`cut_samples` (the samples of one cut where such a block runs its batch in cuts under
`"full"`: `recompute.engine._jax._by_samples` on JAX, `recompute.engine._cuts_tf` on
TensorFlow; `recompute.batch_cut`); on tf_keras, `declared_cut_samples`, for a layer its
builder declared one (`declare_per_sample`: bert4keras's blocks, `recompute.bert4keras`)."""

import weakref

import numpy as np

from ..adapters import _keras3
from ..engine import _jax as _engine, _running


def cut_samples(layer, sublayers, layers, args, kwargs, engine="jax"):
    """The samples of one cut of the batch (`recompute.batch_cut`, the rule of `engine`)
    where `layer`'s call may run by cuts: a block of Keras's attention, `Dense`,
    `LayerNormalization` and `Dropout` layers (`kept_block`), every sublayer built, its
    dropouts without a noise shape, its first floating input of rank 3 or more with its
    axes known when traced, its batch more than one cut. Else None."""
    import keras

    from ..engine._batch_cut import samples_per_cut

    first = next((x for x in keras.tree.flatten((args, kwargs))
                  if getattr(x, "ndim", 0) and "float" in str(getattr(x, "dtype", ""))), None)
    if first is None or first.ndim < 3 or None in tuple(first.shape) \
            or not kept_block(layer, sublayers, layers) or any(
                sub.noise_shape is not None for sub in sublayers
                if isinstance(sub, keras.layers.Dropout)) \
            or not all(sub.built for sub in sublayers):
        return None
    samples = samples_per_cut(int(np.prod(first.shape[1:-1])), engine)
    return samples if samples and first.shape[0] > samples else None


def kept_block(layer, sublayers, attention):
    """True where `layer`'s call is a block: not in shape inference nor inside a recomputed
    call; no weights but its sublayers'; its sublayers its attention layers (with theirs),
    `Dense` layers (unquantized, no LoRA), `LayerNormalization` and `Dropout` layers. On
    JAX `"attention"` runs it as one checkpoint keeping only named values
    (`recompute.policies._jax._block_checkpointed`): then every matrix product of the call
    but the attention's output projection has a named input or output, and the
    recomputation multiplies by no other kernel."""
    import keras

    if _engine.in_shape_inference() or _running.inside_recomputed_call() or not attention:
        return False
    inside = {id(sub) for lyr in attention for sub in _keras3.sublayers(lyr)}
    theirs = {id(v) for sub in sublayers if sub is not layer for v in sub.variables}
    if any(id(v) not in theirs for v in layer.variables):
        return False  # weights of its own: products of its own call, which nothing names
    plain = (keras.layers.LayerNormalization, keras.layers.Dropout)
    for sub in sublayers:
        if sub is layer or id(sub) in inside or type(sub) in plain:
            continue
        if type(sub) is not keras.layers.Dense or sub.quantization_mode is not None \
                or getattr(sub, "lora_enabled", False):
            return False
    return True


_per_sample = weakref.WeakSet()  # the layers declared to compute each sample alone


def declare_per_sample(layer):
    """Declares that `layer`'s call computes each sample of its batch from that sample alone
    (what its builder knows: `recompute.bert4keras`'s blocks), so that under `"full"` it may
    run its batch in cuts on tf_keras (`declared_cut_samples`). The declaration also says
    that every tensor argument whose leading axis is unknown when traced, and every tensor a
    dropout inside draws for, has the batch as its leading axis."""
    _per_sample.add(layer)


def declared_cut_samples(layer, sublayers, args, kwargs):
    """The samples of one cut of the batch (`recompute.batch_cut`, TensorFlow's rule) where
    `layer`, a tf_keras layer, may run its batch in cuts: declared (`declare_per_sample`),
    not inside a recomputed call, every sublayer built, its first floating input of rank 3
    or more, its batch more than one cut where that is known when traced. Else None. Where
    the input's middle axes are known only when the step runs (a sequence length), the
    samples are a scalar tensor. Its random draws are the batch's in each cut or the call
    runs whole (`recompute.adapters._tf_keras.windowed_draws`)."""
    import tensorflow as tf

    from ..engine import _core
    from ..engine._batch_cut import samples_per_cut

    if layer not in _per_sample or _running.inside_recomputed_call() \
            or not all(sub.built for sub in sublayers):
        return None
    # the input the recomputation cuts by (`recompute.engine._cuts_tf.recomputed_call`)
    first = next(iter(_core.float_tensors((args, kwargs))), None)
    if first is None or first.shape.rank in (None, 0, 1, 2):
        return None
    middle = first.shape[1:-1]
    rows = int(np.prod(middle)) if middle.is_fully_defined() \
        else tf.reduce_prod(tf.shape(first)[1:-1])
    samples = samples_per_cut(rows, "tensorflow")
    if samples is None or (isinstance(samples, int) and first.shape[0] is not None
                           and first.shape[0] <= samples):
        return None
    return samples
