"""`batch_cut(samples)`: how many samples one cut of the batch holds where a recomputed call
runs its batch in cuts (a Keras 3 block under `"full"`: on JAX
`recompute.engine._jax._by_samples`, on TensorFlow `recompute.engine._cuts_tf`; a bert4keras
block under `"block"`, on tf_keras), and `samples_per_cut`, the rule that reads it."""

import numbers

from .._setting import Setting

CUT_ROWS = 4096  # by default a cut holds about this many rows on JAX: 8 samples at seq 512
TF_CUT_ROWS = 1024  # on TensorFlow's CPU kernels: 2 samples at seq 512 (on a GPU, CUT_ROWS)

_samples = [None]  # what `batch_cut` set: None (the rule), 0 (no cuts) or the samples


class batch_cut(Setting):
    """Sets how many samples a recomputed call runs at a time under `"full"` and bert4keras's
    `"block"`.

    A call recomputed under `policy="full"` that is a Keras 3 block of Keras's attention,
    `Dense`, `LayerNormalization` and `Dropout` layers (keras-hub's `TransformerEncoder`
    and `TransformerDecoder`, the standard Keras 3 block), on JAX or TensorFlow, and each
    Transformer block of a bert4keras model built under
    `recompute.bert4keras.patch(policy="block")` (or `"block_keep_ffn"`), on tf_keras,
    runs its batch in cuts, in the forward pass and in the recomputation: the step then
    holds one cut's working set of a block, not the batch's, and what a sample adds is the
    block inputs that `"full"` keeps (docs/attention.md, "Cutting the batch"). Dropout draws
    the whole batch's numbers for the cut's samples (with tf_keras's replayable RNG, the
    masks of RECOMPUTE=0; with its default legacy RNG, those of the uncut recomputation);
    the weights' gradients are summed over the cuts. The values equal the uncut call's to
    float rounding. By default
    (`None`) a cut holds about 4,096 rows (`CUT_ROWS`; 8 samples at seq 512), and 1,024
    on TensorFlow where it sees no GPU (`TF_CUT_ROWS`; 2 samples: its CPU kernels run
    products of that size as fast); `0` runs whole batches. As a
    statement it holds for the rest of the process; as a context manager, inside the
    block (restored on exit to what the entry found). It is read when a call is traced
    (in `jax.jit`, `tf.function`, `fit`: at the first step).

    ```python
    import recompute
    recompute.batch_cut(4)          # 4 samples at a time inside each recomputed block
    with recompute.batch_cut(0):    # whole batches inside the block
        ...
    ```

    Limits: on tf_keras, bert4keras's blocks only (other tf_keras calls run whole
    batches); a call of other layers, one that adds a loss or whose dropout has a noise
    shape, runs whole, and on TensorFlow so does a call whose layers are not built yet,
    and a Keras 3 call whose batch size is unknown when traced (`fit`'s retrace for a last,
    partial batch); a bert4keras block whose batch or sequence length is unknown when
    traced (tf_keras's `fit`) runs by cuts counted when the step runs, except under XLA
    (`jit_compile`), where it runs whole. The tensors whose leading axis has the batch's
    length are the ones cut.

    Args:
        samples: an integer >= 0 (0: no cuts), or None for the default.
    """

    _cell = _samples  # the state: `Setting`'s default methods read and write it

    def __init__(self, samples):
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)
                                    or samples < 0):
            raise ValueError("`samples` must be an integer >= 0 or None. "
                             f"Received: samples={samples!r}")
        super().__init__(samples)


def samples_per_cut(rows_per_sample, engine="jax"):
    """The samples of one cut for samples of `rows_per_sample` rows (the positions of an
    input's middle axes) on `engine` ("jax", "tensorflow"), or None where the batch is not
    cut (`batch_cut(0)`). `rows_per_sample` may be a scalar tensor (TensorFlow: a length
    known only when the step runs); the rule's samples are then one too."""
    samples = _samples[0]
    if samples is None:
        rows = TF_CUT_ROWS if engine == "tensorflow" and not _tf_sees_a_gpu() \
            else CUT_ROWS
        if not isinstance(rows_per_sample, numbers.Integral):
            import tensorflow as tf

            return tf.maximum(1, rows // tf.maximum(1, tf.cast(rows_per_sample, tf.int32)))
        return max(1, rows // max(1, int(rows_per_sample)))
    return samples or None


def _tf_sees_a_gpu():
    from ..adapters import _tf  # (imports TensorFlow: only where its engine runs)

    return _tf.sees_a_gpu()
