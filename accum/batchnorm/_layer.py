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

Who is linked: the optimizer that trains the layer. An `AccumOptimizer`
links, when it is built, each `accum.BatchNormalization` whose `gamma` or
`beta` it trains: it sets the layer's `accum_linked` variable and becomes the
layer's owner. The variable is read when the step runs, so a step traced
before the optimizer is built (tf_keras's `fit`, a `tf.function` custom loop)
is linked from its first run. In `fit` and `train_on_batch` the layer also
asks, at each training call (once per trace of a compiled step, so after
every `compile`), which optimizer Keras's train step applies: the model's,
the `self` of the family's `Model.train_step` on the call stack (`accum._callers`:
Keras links a layer to no model). If that is
(or wraps) an `AccumOptimizer` that trains the layer, the layer is linked to
it; if it is a plain optimizer, or an `AccumOptimizer` that does not train
the layer, the layer is unlinked: Keras's layer from then on. A partial
window the layer holds is dropped when it is unlinked or another
`AccumOptimizer` links it, as that optimizer's pending micro-steps are, so it
leaks into no later window; a window loaded with the model's weights is kept
(the optimizer that resumes it is the first to link the layer). Outside
Keras's train step (a custom loop, a `train_step` override that does not
call Keras's) the layer cannot see the optimizer: the `AccumOptimizer` last
built on its variables links it, whatever optimizer the loop applies (a loop
that goes on with a plain optimizer leaves the layer linked). An eager custom
loop must build the optimizer before the first step
(`optimizer.build(model.trainable_variables)`): a layer that already moved
its statistics per batch warns when it is linked. On Keras 3's JAX backend
no `AccumOptimizer` links it (refused when built): it is Keras's layer.

The family is chosen when the layer is constructed: `family="keras3"` or
`"tf_keras"`, else tf_keras when `keras` is tf_keras (bert4keras) or
`TF_USE_LEGACY_KERAS` is set or the calling module imports `tf_keras` and not
Keras 3, else Keras 3.
"""

import os
import sys
import warnings
import weakref

from .. import _callers

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
    `accum.batchnorm._layer` says). Normalization in training still uses each
    micro-batch's own statistics; the moving statistics equal those of a plain
    `BatchNormalization` trained at batch `k · b` (float rounding). Trained by
    a plain optimizer (also after `compile` with one, following an
    `AccumOptimizer`: a partial window is dropped) it is Keras's layer.
    Adds four non-trainable weights (the window's count and two per-channel
    sums, and the link flag), so its weights do not load into a plain
    `BatchNormalization`.

    Limits: the window on the TensorFlow backend and tf_keras (on JAX an
    `AccumOptimizer` refuses it when built; a plain optimizer trains it as
    Keras's layer); not `renorm=True`; an eager custom loop builds the
    optimizer first; in a custom loop the `AccumOptimizer` last built on the
    layer's variables links it, whatever optimizer the loop applies.
    Derivation and the link: `accum.batchnorm._layer`.
    """

    _FAMILY = None
    # `accum._dispatch.batch_normalization_class(family)`, linked by `accum/__init__`
    # (`accum._dispatch.link`; the family implementations import this module).
    _implementation_for = None

    def __new__(cls, *args, family=None, **kwargs):
        if cls is BatchNormalization:
            cls = BatchNormalization._implementation_for(_choose_family(family))
        return super().__new__(cls)

    # -------------------------------------------------- the family's parts
    # `_ops`: a namespace with `sum`, `square`, `where`, `cast`, `maximum`,
    # `reshape`, `zeros_like`, `ones_like`, `logical_and`, `convert` (to a
    # tensor) and `float32`; `_value(v)`: a variable's current tensor;
    # `_WINDOW_WEIGHT`: the family's `add_weight` arguments of a float32
    # non-trainable zeros weight, never autocast;
    # `_train_step_code()`: the code of the family's `Model.train_step`.

    def __init__(self, *args, family=None, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "renorm", False):
            raise ValueError(
                "`accum.BatchNormalization` does not support `renorm=True`: batch "
                "renormalization corrects each batch with the moving statistics, "
                "which move once per window here. Received: renorm=True"
            )

    def _add_window_weight(self, name, shape):
        return self.add_weight(name=name, shape=shape, **self._WINDOW_WEIGHT)

    def build(self, input_shape):
        """The layer's own variables, then the window's (replica-local under a strategy)."""
        from ..modes._distributed import replica_local_variables

        super().build(input_shape)
        shape = self.moving_mean.shape
        with replica_local_variables():
            self.accum_count = self._add_window_weight("accum_count", shape)
            self.accum_sum = self._add_window_weight("accum_sum", shape)
            self.accum_sum_squares = self._add_window_weight("accum_sum_squares", shape)
        self.accum_linked = self._add_window_weight("accum_linked", ())
        self._accum_plain_steps = False
        # Weak reference to the `AccumOptimizer` that linked the layer last (None:
        # none in this process, or unlinked since).
        self._accum_owner = None
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

    # ------------------------------------------------------------ the link

    def _link_for_training_call(self):
        """Brings the link up to date with the optimizer that trains this training call
        (see "Who is linked" in the module docstring) and says how the call treats its
        batch: False, as Keras's layer (a plain optimizer trains it); None, as the
        `accum_linked` variable says when the step runs."""
        model = _callers.self_running(self._train_step_code())
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return None  # a custom loop: the AccumOptimizer built on the layer's variables links it
        accum = _accum_optimizer_in(optimizer)
        trains = accum._links_batch_norm(self) if accum is not None else False
        if trains:
            self._link(accum)
        elif trains is False or (self._accum_owner is not None and self._accum_owner() is not accum):
            # A plain optimizer, or an AccumOptimizer that does not train the layer
            # (or, not built yet, one that links it when built: not the owner).
            self._unlink()
        return None if accum is not None else False

    def _link(self, optimizer):
        """Links the layer to `optimizer`, an `AccumOptimizer` that trains it (at its `build`,
        and at each trace of a train step that applies it). A partial window that another
        `AccumOptimizer` left in the layer is dropped; one loaded with the model's weights
        is kept (the optimizer that resumes it links the layer first)."""
        previous = self._accum_owner
        if previous is None or previous() is not optimizer:
            if self._accum_plain_steps:
                warnings.warn(
                    f"accum.BatchNormalization '{self.name}' moved its moving statistics "
                    "per batch before the AccumOptimizer that trains it was built (an "
                    "eager custom loop). Build the optimizer before the first step "
                    "(`optimizer.build(model.trainable_variables)`) for big-batch "
                    "statistics from the start.",
                    stacklevel=4,
                )
            if previous is not None:
                self._assign_everywhere(self.window_sums(), 0.0)
        self._accum_plain_steps = False
        self._accum_owner = weakref.ref(optimizer)
        self._assign_everywhere([self.accum_linked], 1.0)

    def _unlink(self):
        """No `AccumOptimizer` trains the layer: Keras's layer from now on; the window's
        sums (a partial window of the optimizer that trained it) are dropped."""
        self._accum_owner = None
        self._accum_plain_steps = False
        self._assign_everywhere([self.accum_linked, *self.window_sums()], 0.0)

    @staticmethod
    def _assign_everywhere(variables, value):
        """Sets `variables` to `value` now, on each replica's copy (a variable assigned
        outside the strategy's scope would set the first copy only), also while a step
        is traced (or a scratch graph)."""
        import tensorflow as tf

        with tf.init_scope():
            for variable in variables:
                target = variable if hasattr(variable, "read_value") else variable.value  # Keras 3
                for copy in getattr(target, "values", (target,)):
                    copy.assign(tf.fill(tf.shape(copy), tf.constant(value, copy.dtype)))


def _accum_optimizer_in(optimizer):
    """The `AccumOptimizer` that `optimizer` is or wraps (a `LossScaleOptimizer` around it), or None."""
    from .._callers import chain
    from .._recompile import is_accum_optimizer

    return next((o for o in chain(optimizer) if is_accum_optimizer(o)), None)


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
    # The module constructing the layer (from `__new__`'s caller on, past Keras's and ours).
    modules = _callers.caller_imports(("accum", "keras", "tf_keras"), depth=2)
    if modules is not None:
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
