"""Device-local micro-steps on JAX: `accum.local_gradients(model)`.

Under `keras.distribution` (`DataParallel`, or `ModelParallel` with a batch
axis), Keras's JAX trainer jits the whole step over the global batch, and
XLA all-reduces every gradient right after the backward pass: `k` times per
update of `AccumOptimizer(..., k)`. `local_gradients(model)` gives the model
a train step that keeps each micro-step's gradients on the device that
computed them and all-reduces once per update:

- the forward and backward pass run under `jax.shard_map`, manual over the
  batch axis only (a `ModelParallel` model axis stays XLA's): each device
  computes the loss of its shard of the batch and its gradients, divided by
  the number of shards n, and stacks them on a leading axis of length n
  (sharded over the batch axis: nothing moves);
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
gradient each time); the model's own `train_step` is replaced (a subclass
that overrides it keeps Keras's per-micro-step reduction).
"""

import types

import keras

_SEED_STATE = "seed_generator_state"
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def local_gradients(model):
    """Keeps each micro-step's gradients on their device; all-reduces once per update.

    For Keras 3 on JAX under a `keras.distribution` with a batch axis, with
    `model` compiled with an `AccumOptimizer` (`mode="buffer"`): `fit` and
    `train_on_batch` then compute each device's gradients of its shard of
    the batch under `jax.shard_map`, add them to that device's row of the
    optimizer's buffers, and sum the rows across devices once, at the end
    of each window of `steps_per_update` micro-steps (instead of one
    all-reduce of every gradient per micro-step).

    ```python
    with keras.distribution.DataParallel().scope():
        model = build_model()
        model.compile(AccumOptimizer(keras.optimizers.AdamW(1e-4), 8), loss="mse")
    accum.local_gradients(model)
    model.fit(x, y, batch_size=64)      # 8 micro-batches of 64 per update, 1 all-reduce
    ```

    Returns `model` (changed in place: its `train_step` and
    `make_train_function`, as instance attributes). Exact where the batch's
    loss is the mean of its shards' losses; dropout draws each device's own
    masks; refused with the reason elsewhere (`accum._local_jax`'s
    docstring lists both). Call it again after `compile` with another
    optimizer.
    """
    _check_model(model)
    model.train_step = types.MethodType(_train_step, model)
    model.make_train_function = types.MethodType(_make_train_function, model)
    model.train_function = None
    return model


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
    if not _is_buffered_accum(optimizer):
        raise ValueError(
            "`accum.local_gradients` needs a model compiled with "
            '`AccumOptimizer(..., mode="buffer")`: the buffers hold the devices\' rows. '
            "Compile the model first. Received: "
            f"optimizer={optimizer!r}"
            + (f' with mode="{optimizer.mode}"' if hasattr(optimizer, "mode") else "")
        )
    if model.run_eagerly or not model.jit_compile:
        raise ValueError(
            "`accum.local_gradients` needs a jitted train step: compile with "
            "`run_eagerly=False` and `jit_compile=True` (the defaults on JAX). Received: "
            f"run_eagerly={model.run_eagerly}, jit_compile={model.jit_compile}"
        )
    _mesh_and_axis()
    _check_losses(model)


def _is_buffered_accum(optimizer):
    from ._base import AccumOptimizer

    return isinstance(optimizer, AccumOptimizer) and optimizer.mode == "buffer"


def _mesh_and_axis():
    """The distribution's JAX mesh and batch axis name, and the number of shards."""
    distribution = keras.distribution.distribution()
    axis = getattr(distribution, "batch_dim_name", None)
    if distribution is None or axis is None:
        raise ValueError(
            "`accum.local_gradients` needs a `keras.distribution` with a batch axis "
            "(`DataParallel`, or `ModelParallel(..., batch_dim_name=...)`), set with "
            "`keras.distribution.set_distribution` or active in its `scope()`. "
            f"Received: distribution={distribution!r}"
        )
    mesh = distribution.device_mesh
    return mesh, axis, mesh.shape[list(mesh.axis_names).index(axis)]


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
    """Gives the optimizer's buffers one row per shard (once), then Keras's own."""
    mesh, axis, shards = _mesh_and_axis()
    if not _is_buffered_accum(self.optimizer):
        _check_model(self)  # compiled again with another optimizer: say why
    converted = self.optimizer._use_device_rows(mesh, axis, shards)
    type(self).make_train_function(self, force=force or converted)


def _train_step(self, state, data):
    """Keras's JAX `train_step`, with each device's gradients of its shard kept local."""
    import jax
    from jax.sharding import PartitionSpec as P

    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mesh, axis, shards = _mesh_and_axis()
    seeds = [i for i, v in enumerate(self.non_trainable_variables) if _is_seed_state(v)]

    def loss_and_updates(*args, **kwargs):
        result = self.compute_loss_and_updates(*args, **kwargs)
        _check_unmasked(result[1][1])  # the mask is on the traced prediction only
        return result

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
        grads = [(g / shards)[None] for g in grads]
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
    logs, metrics = self._update_metrics_variables(
        metrics, jax.numpy.mean(losses), x, y, y_pred, sample_weight)
    return logs, (trainable, non_trainable, optimizer_values, metrics)


def _is_seed_state(variable):
    return variable.name == _SEED_STATE and not variable.trainable


def _check_unmasked(y_pred):
    from keras.src import backend  # its `get_keras_mask` (Keras's losses read it) is not public

    for leaf in keras.tree.flatten(y_pred):
        if backend.get_keras_mask(leaf) is not None:
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
