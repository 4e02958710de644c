"""Device-local micro-steps on JAX: `accum.local_gradients(model)`.

Under `keras.distribution` (`DataParallel`, or `ModelParallel` with a batch
axis), Keras's JAX trainer jits the whole step over the global batch, and
XLA all-reduces every gradient right after the backward pass: `k` times per
update of `AccumOptimizer(..., k)`. `local_gradients(model)` gives the model
a train step that keeps each micro-step's gradients on the device that
computed them and all-reduces once per update:

- the forward and backward pass run under `jax.shard_map`, manual over the
  batch axis only (a `ModelParallel` model axis stays XLA's): each device
  computes the loss of its shard of the batch, divided by the number of
  shards n, and its gradients (its part of the batch's: under
  `mixed_float16`'s loss scaling the float16 gradients are those of Keras's
  step), and stacks them on a leading axis of length n (sharded over the
  batch axis: nothing moves);
- the `AccumOptimizer`'s buffers hold one row per shard (`DeviceRows`:
  shape `(n, *weight.shape)`, laid out over the batch axis and then as the
  weight is), so a micro-step adds each device's gradients to its own row;
- at the window's end the rows are summed (`rows_total`: the one all-reduce,
  inside the `jax.lax.cond` that runs the inner optimizer) and the mean of
  the window updates the weights as before.

The rows' sum is the buffer the optimizer would hold without this: it is
what is saved (`save_own_variables`) and what a loaded buffer is restored
into (row 0), so checkpoints do not depend on the number of devices, and a
step that hands the optimizer gradients already reduced (a custom
`stateless_apply` step) adds them to row 0.

Exact (the same weights as the same model on one device at the same global
batch, to float rounding) when the global batch's loss is the mean of the
shards' losses: Keras's default reduction (`"sum_over_batch_size"`, with or
without sample weights) over shards of equal size, and regularization terms
that do not depend on the batch. Refused where it would not be, with the
reason: a loss with another reduction, predictions carrying a Keras mask
(the mean would be over each shard's unmasked entries), and layers that
update non-trainable state from the batch (`BatchNormalization`: each
device would see only its shard's moments). Random draws (dropout) are
each device's own: each device folds its index into every seed state
(`jax.random.fold_in`), so the shards draw independent masks, as data
parallelism does elsewhere, but not the masks one device draws for the
whole batch (Keras's default step does draw those); the seed states then
advance as one device's would. RECOMPUTE=1 replays the same draws.

Limits: the JAX backend with `jit_compile` (Keras's default there), Flax
NNX off; `AccumOptimizer` in `mode="buffer"` (`"rescale"` folds every
micro-step into the inner optimizer's moments, which needs the reduced
gradient each time), or Keras's `LossScaleOptimizer` around one
(`mixed_float16`); the model's own `train_step` is replaced (a subclass
that overrides it keeps Keras's per-micro-step reduction); every batch
splits evenly over the shards (`fit` on arrays checks `batch_size` and an
epoch's last partial batch before training; a dataset's partial batch is
refused when it comes, in Keras's terms instead of JAX's). `local_gradients`
and `fit` run in the distribution's scope. Compiling the model with an
optimizer that is not, or does not wrap, a buffered `AccumOptimizer` gives
it back Keras's own step (so does `local_gradients(model, enabled=False)`).
"""

import keras

from .. import _shadow
from . import _inner

_SEED_STATE = "seed_generator_state"
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def local_gradients(model, enabled=True):
    """Keeps each micro-step's gradients on their device; all-reduces once per update.

    For Keras 3 on JAX under a `keras.distribution` with a batch axis, with
    `model` compiled with an `AccumOptimizer` (`mode="buffer"`; under
    `mixed_float16`, in the `LossScaleOptimizer` that `compile` wraps it in):
    `fit` and `train_on_batch` then compute each device's gradients of its
    shard of the batch under `jax.shard_map`, add them to that device's row
    of the optimizer's buffers, and sum the rows across devices once, at the
    end of each window of `steps_per_update` micro-steps (instead of one
    all-reduce of every gradient per micro-step). Call it, and `fit`, in the
    distribution's scope (or after `keras.distribution.set_distribution`):

    ```python
    with keras.distribution.DataParallel().scope():
        model = build_model()
        model.compile(AccumOptimizer(keras.optimizers.AdamW(1e-4), 8), loss="mse")
        accum.local_gradients(model)
        model.fit(x, y, batch_size=64)  # 8 micro-batches of 64 per update, 1 all-reduce
    ```

    Every batch must split evenly over the batch axis's shards: `fit` on
    arrays refuses a `batch_size`, or an epoch's last partial batch, that
    does not, before it trains.

    Returns `model` (changed in place: its `train_step`,
    `make_train_function`, `fit` and `train_on_batch`, as instance
    attributes). Exact where the batch's loss is the mean of its shards'
    losses; dropout draws each device's own masks; refused with the reason
    elsewhere (`accum.keras3._local_jax`'s docstring lists both). Compiling the
    model again with another `AccumOptimizer(..., mode="buffer")` keeps the
    step (the next `fit` gives the new buffers their rows: no second call
    needed); compiling it with any other optimizer gives it back Keras's own
    step, as does `local_gradients(model, enabled=False)`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool. Received: enabled={enabled!r}")
    if not enabled:
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a `keras.Model`. Received: model={model!r}")
        _restore_keras_step(model)
        return model
    _check_model(model)
    _shadow.replace_methods(model, {
        "train_step": _train_step, "make_train_function": _make_train_function,
        "fit": _fit, "train_on_batch": _train_on_batch,
    })
    model.train_function = None
    return model


_REPLACED = ("train_step", "make_train_function", "fit", "train_on_batch")


def _restore_keras_step(model):
    """Removes `local_gradients`' instance methods: the model's class's own step again."""
    if _shadow.restore_methods(model, _REPLACED):
        model.train_function = None


# ------------------------------------------------------------------ checks

def _check_model(model):
    if keras.backend.backend() != "jax":
        raise ValueError(
            "`accum.local_gradients` needs the JAX backend (on TensorFlow, "
            "`tf.distribute` already all-reduces once per update: see "
            f"docs/distribution.md). Received: backend={keras.backend.backend()!r}"
        )
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a `keras.Model`. Received: model={model!r}")
    if keras.config.is_nnx_enabled():
        raise ValueError(
            "`accum.local_gradients` does not support Flax NNX models (Keras's trainer "
            "calls the class's `train_step` then). Received: nnx enabled"
        )
    optimizer = getattr(model, "optimizer", None)
    if _buffered_accum(optimizer) is None:
        raise ValueError(
            "`accum.local_gradients` needs a model compiled with "
            '`AccumOptimizer(..., mode="buffer")` (under `mixed_float16`, in the '
            "`LossScaleOptimizer` that `compile` wraps it in): the buffers hold the "
            "devices' rows. "
            + ("Compile the model first. " if optimizer is None else "")
            + f"Received: optimizer={_describe(optimizer)}"
        )
    if model.run_eagerly or not model.jit_compile:
        raise ValueError(
            "`accum.local_gradients` needs a jitted train step: compile with "
            "`run_eagerly=False` and `jit_compile=True` (the defaults on JAX). Received: "
            f"run_eagerly={model.run_eagerly}, jit_compile={model.jit_compile}"
        )
    _mesh_and_axis(model)
    _check_losses(model)


def _buffered_accum(optimizer):
    """The `AccumOptimizer` in `mode="buffer"` that `optimizer` is, or wraps (Keras's
    `LossScaleOptimizer` around it), or None."""
    from .._base import AccumOptimizer
    from .._callers import chain

    return next((o for o in chain(optimizer)
                 if isinstance(o, AccumOptimizer) and o.mode == "buffer"), None)


def _describe(optimizer):
    """`optimizer`'s repr, with the optimizers it wraps and an `AccumOptimizer`'s mode."""
    from .._callers import chain

    described = []
    for o in chain(optimizer) or [None]:
        described.append(repr(o) + (f' with mode="{o.mode}"' if hasattr(o, "mode") else ""))
    return ", wrapping ".join(described)


def _mesh_and_axis(model=None):
    """The distribution's JAX mesh and batch axis name, and the number of shards."""
    distribution = keras.distribution.distribution()
    axis = getattr(distribution, "batch_dim_name", None)
    if distribution is None or axis is None:
        built_under = _mesh_of(model)
        raise ValueError(
            "`accum.local_gradients` needs a `keras.distribution` with a batch axis "
            "(`DataParallel`, or `ModelParallel(..., batch_dim_name=...)`), set with "
            "`keras.distribution.set_distribution` or active in its `scope()`: call "
            "`local_gradients` and `fit` inside the `with distribution.scope():` that "
            "builds and compiles the model. "
            + (f"(The model's variables lie on a mesh {built_under}: it was built under "
               "a distribution that is not active now.) " if built_under else "")
            + f"Received: distribution={distribution!r}"
        )
    mesh = distribution.device_mesh
    return mesh, axis, mesh.shape[list(mesh.axis_names).index(axis)]


def _mesh_of(model):
    """The shape of the JAX mesh `model`'s first variable is laid out on, or None."""
    for variable in getattr(model, "variables", None) or []:
        mesh = getattr(getattr(getattr(variable, "value", None), "sharding", None), "mesh", None)
        if mesh is not None:
            return dict(mesh.shape)
    return None


def _check_losses(model):
    """Refuses compiled losses whose reduction is not a mean over the batch."""
    for loss in keras.tree.flatten(getattr(model, "loss", None)):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                "`accum.local_gradients` is exact only for losses that are a mean over "
                'the batch (reduction "sum_over_batch_size", Keras\'s default): each '
                "device's gradients are of its shard's loss, and the shards' mean is the "
                f"batch's. Received: loss={loss!r} with reduction={reduction!r}"
            )


# -------------------------------------------------------------- the step

def _make_train_function(self, force=False):
    """Gives the optimizer's buffers one row per shard (once), then Keras's own; Keras's
    own step again if the model was compiled with another optimizer since."""
    if not _still_local(self):
        return self.make_train_function(force=True)
    mesh, axis, shards = _mesh_and_axis(self)
    converted = _buffered_accum(self.optimizer)._use_device_rows(mesh, axis, shards)
    type(self).make_train_function(self, force=force or converted)


def _still_local(model):
    """False (and Keras's own step restored) once `model` is compiled with an optimizer
    that is not, and does not wrap, an `AccumOptimizer(..., mode="buffer")`."""
    if _buffered_accum(getattr(model, "optimizer", None)) is not None:
        return True
    _restore_keras_step(model)
    return False


def _fit(self, *args, **kwargs):
    """Keras's `fit`, after refusing batches that do not split over the shards (arrays:
    before training), and with JAX's error for one found in training (a dataset's last
    partial batch) said in Keras's terms."""
    fit = type(self).fit
    if not _still_local(self):
        return fit(self, *args, **kwargs)
    _, axis, shards = _mesh_and_axis(self)
    _check_array_batches(fit, self, args, kwargs, axis, shards)
    try:
        return fit(self, *args, **kwargs)
    except ValueError as error:
        _reraise_indivisible(error, axis, shards)
        raise


def _train_on_batch(self, x, *args, **kwargs):
    """Keras's `train_on_batch`, after refusing a batch that does not split over the shards."""
    if not _still_local(self):
        return self.train_on_batch(x, *args, **kwargs)
    _, axis, shards = _mesh_and_axis(self)
    size = _samples(x)
    if size is not None and size % shards:
        raise ValueError(
            f"{_SPLIT.format(shards=shards, axis=axis)} Received: a batch of {size} samples"
        )
    return type(self).train_on_batch(self, x, *args, **kwargs)


_SPLIT = (
    "`accum.local_gradients` needs every batch to split evenly over the {shards} shards "
    "of the batch axis {axis!r} (each device computes the loss of an equal share, and "
    "the batch's loss is their mean): a batch size that is a multiple of {shards}."
)


def _samples(x):
    """The number of samples in `x` (its first array's leading dimension), or None for
    inputs without a shape (a `tf.data.Dataset`, a generator, a `PyDataset`)."""
    for leaf in keras.tree.flatten(x) if x is not None else []:
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) >= 1 and shape[0] is not None:
            return int(shape[0])
        return None
    return None


def _check_array_batches(fit, model, args, kwargs, axis, shards):
    """Refuses `fit`'s `batch_size`, or an epoch's last partial batch, where `x` is arrays
    and a batch would not split over the `shards` (one process: with several, each
    feeds its own share, which JAX checks)."""
    import inspect
    import math

    import jax

    try:
        bound = inspect.signature(fit).bind(model, *args, **kwargs)
    except TypeError:
        return  # Keras's fit says what is wrong
    arguments = bound.arguments
    samples = _samples(arguments.get("x"))
    if samples is None or jax.process_count() > 1:
        return
    batch_size = arguments.get("batch_size") or 32  # Keras's default for arrays
    if arguments.get("validation_data") is None and arguments.get("validation_split"):
        samples = int(math.floor(samples * (1.0 - arguments["validation_split"])))
    message = _SPLIT.format(shards=shards, axis=axis)
    if batch_size % shards:
        raise ValueError(f"{message} Received: batch_size={batch_size}")
    steps = arguments.get("steps_per_epoch")
    last = samples % batch_size
    if last % shards and (steps is None or steps > samples // batch_size):
        raise ValueError(
            f"{message} Received: {samples} training samples in batches of {batch_size}: "
            f"each epoch's last batch would hold {last}. Drop the remainder (train on the "
            f"first {samples - last} samples), or choose a number of samples whose "
            f"remainder modulo batch_size={batch_size} is a multiple of {shards}."
        )


def _reraise_indivisible(error, axis, shards):
    """A Keras-style `ValueError` from JAX's error for a batch that does not split over
    the shards (found when `fit` lays the batch out: a dataset's last partial batch)."""
    if not any(c.__name__ == "IndivisibleError" for c in type(error).__mro__):
        return
    raise ValueError(
        f"{_SPLIT.format(shards=shards, axis=axis)} A batch of this `fit` did not: where "
        "the batches before it trained, it is the last, partial batch of an epoch (the "
        "dataset's size is not a multiple of the batch size). Drop the remainder "
        "(`dataset.batch(batch_size, drop_remainder=True)`, or fewer samples) or make each "
        f"batch a multiple of {shards}. Received: {error}"
    ) from error


def _train_step(self, state, data):
    """Keras's JAX `train_step`, with each device's gradients of its shard kept local."""
    import jax
    from jax.sharding import PartitionSpec as P

    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mesh, axis, shards = _mesh_and_axis(self)
    seeds = [i for i, v in enumerate(self.non_trainable_variables) if _is_seed_state(v)]

    def loss_and_updates(*args, **kwargs):
        # The shard's (scaled) loss over the number of shards: its gradients are this
        # shard's part of the batch's, of the batch's size (as XLA's in Keras's step:
        # under loss scaling, float16 gradients that overflow exactly where Keras's do).
        loss, aux = self.compute_loss_and_updates(*args, **kwargs)
        _check_unmasked(aux[1])  # the mask is on the traced prediction only
        return loss / shards, aux

    def local(trainable, non_trainable, metrics, x, y, sample_weight):
        index = jax.lax.axis_index(axis)
        folded = list(non_trainable)
        for i in seeds:
            folded[i] = jax.random.fold_in(non_trainable[i], index)
        (_, aux), grads = jax.value_and_grad(loss_and_updates, has_aux=True)(
            trainable, folded, metrics, x, y, sample_weight,
            training=True, optimizer_variables=optimizer_values)
        loss, y_pred, new_non_trainable, new_metrics = aux
        new_non_trainable = list(new_non_trainable)
        for i, (old, new) in enumerate(zip(folded, new_non_trainable)):
            if i in seeds:  # advance the shared state by this device's draws
                new_non_trainable[i] = non_trainable[i] + (new - old)
            elif new is not old:
                _refuse_state_update(self.non_trainable_variables[i])
        increments = [(new - old)[None] for old, new in zip(metrics, new_metrics)]
        grads = [g[None] for g in grads]
        return grads, loss[None], y_pred, new_non_trainable, increments

    data_spec = P(axis)
    grads, losses, y_pred, non_trainable, increments = jax.shard_map(
        local, mesh=mesh.backend_mesh, axis_names={axis},
        in_specs=(P(), P(), P(), data_spec, data_spec, data_spec),
        out_specs=(data_spec, data_spec, data_spec, P(), data_spec),
        check_vma=False,
    )(trainable, non_trainable, metrics, x, y, sample_weight)
    metrics = [m + jax.numpy.sum(d, axis=0) for m, d in zip(metrics, increments)]
    trainable, optimizer_values = self.optimizer.stateless_apply(optimizer_values, grads, trainable)
    logs, metrics = _inner.update_metrics_variables(
        self, metrics, jax.numpy.mean(losses), x, y, y_pred, sample_weight)
    return logs, (trainable, non_trainable, optimizer_values, metrics)


def _is_seed_state(variable):
    return variable.name == _SEED_STATE and not variable.trainable


def _check_unmasked(y_pred):
    for leaf in keras.tree.flatten(y_pred):
        if _inner.keras_mask(leaf) is not None:
            raise ValueError(
                "`accum.local_gradients` is exact only when the batch's loss is the mean "
                "of its shards' losses; a loss over predictions with a Keras mask is a "
                "mean over each shard's unmasked entries, which is not. Use Keras's "
                "default step (without `local_gradients`), or sample weights instead of "
                f"the mask. Received: a prediction of shape {leaf.shape} with a mask"
            )


def _refuse_state_update(variable):
    raise ValueError(
        "`accum.local_gradients` cannot train a model that updates non-trainable state "
        "from the batch: each device sees only its shard (a `BatchNormalization`'s "
        "moments would be its shard's, not the batch's). Use Keras's default step "
        "(without `local_gradients`). Received: the non-trainable variable "
        f"{variable.path!r} changes in training"
    )


# ------------------------------------------------ the optimizer's buffers

class DeviceRows:
    """The buffers' layout under `local_gradients`: `shards` rows, one per shard of the
    batch axis `axis` of `mesh` (a `keras.distribution.DeviceMesh`)."""

    def __init__(self, mesh, axis, shards):
        self.mesh, self.axis, self.shards = mesh, axis, shards

    def buffer_for(self, weight, name):
        """A zero `keras.Variable` of shape `(shards, *weight.shape)`, laid out over the
        batch axis, then as `weight` is."""
        distribution = keras.distribution.distribution()
        axes = tuple(distribution.get_variable_layout(weight).axes)
        layout = keras.distribution.TensorLayout((self.axis, *axes), self.mesh)
        return keras.Variable(
            initializer="zeros", shape=(self.shards, *weight.shape), dtype=weight.dtype,
            trainable=False, name=name, layout=layout,
        )


class SavedRows:
    """A buffer with rows as `AccumOptimizer`'s checkpoint sees it: saved as the rows'
    sum, restored into row 0 (so checkpoints do not depend on the device count)."""

    def __init__(self, variable):
        self.variable = variable
        self.shape = tuple(variable.shape[1:])
        self.dtype = variable.dtype

    def numpy(self):
        """The rows' sum, summed where the rows are (so on every process of several: the
        rows of a buffer laid out across processes are not all readable by one)."""
        import jax
        import numpy as np

        return np.asarray(jax.jit(lambda rows: rows.sum(axis=0))(self.variable.value))

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value):
        import numpy as np

        rows = np.zeros(self.variable.shape, dtype=self.variable.dtype)
        rows[0] = np.asarray(value)
        self.variable.assign(rows)
