"""`accum.BatchNormalization`: moving statistics of the whole `k · b` batch, updated once per window.

Inside a micro-batch a BatchNormalization layer normalizes with that
micro-batch's mean and variance (nothing can change that without seeing the
whole big batch), but its *moving* statistics can be those of the big batch,
exactly. In training, while an `AccumOptimizer` trains it, the layer does not
move its moving mean and variance per micro-batch: it adds, per channel, the
micro-batch's element count `n`, `Σ (x − s)` and `Σ (x − s)²` to three small
window variables, with the shift `s` = the moving mean (constant during a
window, it keeps the sums well conditioned). At the end of each window the
optimizer calls `finish_window`, which forms the big batch's mean
`s + Σ(x − s)/n` and (biased, as Keras's) variance `Σ(x − s)²/n − (Σ(x − s)/n)²`
and moves the moving statistics once, with the layer's `momentum`, as the
plain layer does at batch `k · b`; then zeroes the sums. A partial window
(`flush()`) counts the micro-batches it has, like a smaller last batch.

Under a `tf.distribute` strategy the sums are replica-local (`ON_READ`,
summed): the window's end reads them in the cross-replica context, one
reduction per window, so the statistics are those of the global batch
(`k · b` times the replicas), as `SyncBatchNormalization` at that batch.

Who is linked: an `AccumOptimizer` links, when it is built, each
`accum.BatchNormalization` whose `gamma` or `beta` it trains (sets the
layer's `accum_linked` variable). A layer no `AccumOptimizer` trains behaves
as Keras's. The decision is a variable, read when the step runs, so a step
traced before the optimizer is built (tf_keras's `fit`, a `tf.function`
custom loop) is linked from its first run. An eager custom loop must build
the optimizer before the first step (`optimizer.build(model.trainable_variables)`):
a layer that already moved its statistics per batch warns when it is linked.

The family is chosen when the layer is constructed: `family="keras3"` or
`"tf_keras"`, else tf_keras when `keras` is tf_keras (bert4keras) or
`TF_USE_LEGACY_KERAS` is set or the calling module imports `tf_keras` and not
Keras 3, else Keras 3.
"""

import os
import sys
import warnings
import weakref

KERAS3, TF_KERAS = "keras3", "tf_keras"
# Every built `accum.BatchNormalization`, for the optimizers to find theirs.
_LAYERS = weakref.WeakSet()


class BatchNormalization:
    """A drop-in `BatchNormalization` whose moving statistics, under an `AccumOptimizer`,
    are those of the whole `k · b` batch, updated once per window.

    ```python
    model = keras.Sequential([..., accum.BatchNormalization(), ...])
    model.compile(optimizer=accum.AccumOptimizer(keras.optimizers.Adam(), 8), loss=...)
    model.fit(x, y, batch_size=4)   # moving mean/variance: those of batch 32
    ```

    Takes Keras's `BatchNormalization` arguments, plus `family` (`"keras3"` or
    `"tf_keras"`; by default chosen as the module docstring of
    `accum._batchnorm_window` says). Normalization in training still uses each
    micro-batch's own statistics; the moving statistics equal those of a plain
    `BatchNormalization` trained at batch `k · b` (float rounding). Without an
    `AccumOptimizer` it is Keras's layer. Adds four non-trainable weights (the
    window's count and two per-channel sums, and the link flag), so its
    weights do not load into a plain `BatchNormalization`.

    Limits: TensorFlow backend and tf_keras (on JAX an `AccumOptimizer` refuses
    it when built); not `renorm=True`; an eager custom loop builds the
    optimizer first. Derivation: `accum._batchnorm_window`.
    """

    _FAMILY = None
    # `accum._dispatch.batch_normalization_class(family)`, set when `accum` is
    # imported (the family implementations import this module).
    _implementation_for = None

    def __new__(cls, *args, family=None, **kwargs):
        if cls is BatchNormalization:
            cls = BatchNormalization._implementation_for(_choose_family(family))
        return super().__new__(cls)

    # -------------------------------------------------- the family's parts
    # `_ops`: a namespace with `sum`, `square`, `where`, `cast`, `maximum`,
    # `reshape`, `zeros_like`, `ones_like`, `logical_and`, `convert` (to a
    # tensor) and `float32`; `_value(v)`: a variable's current tensor;
    # `_add_window_weight(name, shape)`: a float32 non-trainable zeros weight.

    def __init__(self, *args, family=None, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "renorm", False):
            raise ValueError(
                "`accum.BatchNormalization` does not support `renorm=True`: batch "
                "renormalization corrects each batch with the moving statistics, "
                "which move once per window here. Received: renorm=True"
            )

    def build(self, input_shape):
        """The layer's own variables, then the window's (replica-local under a strategy)."""
        from ._distributed import replica_local_variables

        super().build(input_shape)
        shape = self.moving_mean.shape
        with replica_local_variables():
            self.accum_count = self._add_window_weight("accum_count", shape)
            self.accum_sum = self._add_window_weight("accum_sum", shape)
            self.accum_sum_squares = self._add_window_weight("accum_sum_squares", shape)
        self.accum_linked = self._add_window_weight("accum_linked", ())
        self._accum_plain_steps = False
        _LAYERS.add(self)

    def _accumulate(self, x, reduction_axes, broadcast_shape, on, weights=None):
        """Adds the micro-batch `x` (float32) to the window's sums where `on` (a bool tensor)."""
        ops = self._ops
        shift = ops.reshape(ops.cast(self._value(self.moving_mean), ops.float32), broadcast_shape)
        centered = x - shift
        if weights is None:
            weights = ops.ones_like(centered)
        count = ops.sum(weights, reduction_axes)
        s1 = ops.sum(centered * weights, reduction_axes)
        s2 = ops.sum(ops.square(centered) * weights, reduction_axes)
        for variable, value in ((self.accum_count, count), (self.accum_sum, s1), (self.accum_sum_squares, s2)):
            current = self._value(variable)
            variable.assign(ops.where(on, current + ops.reshape(value, current.shape), current))

    def window_sums(self):
        """The window's `(count, Σ(x − s), Σ(x − s)²)` variables."""
        return self.accum_count, self.accum_sum, self.accum_sum_squares

    def finish_window(self, when=True, sums=None):
        """Moves the moving statistics once with the window's big-batch statistics
        (if it holds any) and empties the window, where `when` (a bool tensor or
        `True`) holds. Called by the `AccumOptimizer` at the end of each window;
        under a strategy with `sums`, the `window_sums()` summed over the replicas."""
        ops = self._ops
        count, s1, s2 = sums if sums is not None else [self._value(v) for v in self.window_sums()]
        n = ops.maximum(count, 1.0)
        mean_shifted = s1 / n
        variance = self._window_variance(ops.maximum(s2 / n - ops.square(mean_shifted), 0.0), n)
        apply = ops.logical_and(ops.convert(when), count > 0)
        momentum = self.momentum
        for variable, value in (
            (self.moving_mean, ops.cast(self._value(self.moving_mean), ops.float32) + mean_shifted),
            (self.moving_variance, variance),
        ):
            current = self._value(variable)
            new = ops.cast(current, ops.float32) * momentum + value * (1.0 - momentum)
            variable.assign(ops.where(apply, ops.cast(new, current.dtype), current))
        for variable in (self.accum_count, self.accum_sum, self.accum_sum_squares):
            current = self._value(variable)
            variable.assign(ops.where(ops.convert(when), ops.zeros_like(current), current))

    def _window_variance(self, variance, count):
        """The variance the family's layer moves its statistics with (biased: Keras 3,
        tf_keras non-fused), from the biased one over `count` elements."""
        return variance

    def _link(self, optimizer):
        if self._accum_plain_steps:
            warnings.warn(
                f"accum.BatchNormalization '{self.name}' moved its moving statistics "
                "per batch before the AccumOptimizer that trains it was built (an "
                "eager custom loop). Build the optimizer before the first step "
                "(`optimizer.build(model.trainable_variables)`) for big-batch "
                "statistics from the start.",
                stacklevel=4,
            )
        import tensorflow as tf

        with tf.init_scope():  # `build` may run while a step is traced (or a scratch graph)
            target = self.accum_linked
            target = target if hasattr(target, "read_value") else target.value  # Keras 3
            # Each replica's copy (a mirrored variable assigned outside the strategy's
            # scope would set the first copy only).
            for copy in getattr(target, "values", (target,)):
                copy.assign(tf.ones_like(copy))


def _choose_family(family):
    if family is not None:
        if family not in (KERAS3, TF_KERAS):
            raise ValueError(
                f'`family` must be "{KERAS3}" or "{TF_KERAS}". Received: family={family!r}'
            )
        return family
    keras_module = sys.modules.get("keras")
    if keras_module is not None and getattr(keras_module, "__name__", "") == "tf_keras":
        return TF_KERAS
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
        return TF_KERAS
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("accum", "keras", "tf_keras")):
        frame = frame.f_back
    if frame is not None:
        modules = {getattr(v, "__name__", None) for v in frame.f_globals.values() if type(v) is type(sys)}
        uses_tf_keras = any(m and (m == "tf_keras" or m.startswith("tf_keras.")) for m in modules)
        uses_keras3 = any(m and (m == "keras" or m.startswith("keras.")) for m in modules)
        if uses_tf_keras and not uses_keras3:
            return TF_KERAS
    return KERAS3


def layers_trained_by(var_list):
    """The built `accum.BatchNormalization` layers whose `gamma` or `beta` is in `var_list`."""
    ids = {id(v) for v in var_list}
    return [layer for layer in list(_LAYERS) if any(id(w) in ids for w in layer.trainable_weights)]


def finish_windows(layers, when=True, reduce=None):
    """`finish_window(when)` of each layer (the optimizer's window end). `reduce`: under a
    strategy, `fn(variables) -> values` summing replica-local variables over the replicas."""
    if reduce is not None and layers:
        sums = reduce([v for layer in layers for v in layer.window_sums()])
        for i, layer in enumerate(layers):
            layer.finish_window(when, sums[3 * i:3 * i + 3])
        return
    for layer in layers:
        layer.finish_window(when)
