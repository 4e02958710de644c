"""`keras.distribution` on 4 virtual CPU devices, in a process of its own
(tests/accum_jax/test_distribution_jax.py runs it).

JAX reads the number of CPU devices once, when it initializes, from
`XLA_FLAGS=--xla_force_host_platform_device_count=4`; a pytest process has
initialized JAX long before a test runs, so the runs live here:
`python -m tests.helpers.jax_distribution_worker OUT_DIR [SCENARIO ...]` sets
the flag and `KERAS_BACKEND=jax`, pins float32 (`recompute.exact_float32()`),
runs each scenario (all of `SCENARIOS` and the all-reduce counts by default) and
writes `OUT_DIR/<scenario>.npz`: the arrays of each run, `<run>_<i>` (`ref`: one
device; `got`: the distributed run; `same`: the distributed run without
recomputation, where there is one), their names `names`, and `sharded`, the
paths of the variables the distribution laid out over the "model" axis
(`allreduce_counts.npz`: `labels`, `counts`). The test compares them; the
worker asserts nothing but that it ran.

```bash
python -m tests.helpers.jax_distribution_worker /tmp/out accum_buffer_dp_fit allreduce_counts
```

Each exactness scenario trains the same model from the same weights on the same
global batches on one device (no distribution; computed once per process) and
under a distribution, in the same process:

- `accum_<mode>_<dist>_<how>`: `AccumOptimizer` (`mode` "buffer" with Adam,
  "rescale" with SGD + momentum), k = 3, 7 micro-steps of global batch 8 (two
  updates, one pending), through `fit` or through a jitted `stateless_call` +
  `stateless_apply` step; the weights and every optimizer variable;
- `recompute_<dist>_<how>`: a `@recompute_grad` block model (seeded dropout,
  `add_loss`, residual) with RECOMPUTE=1 against one device with RECOMPUTE=0:
  weights after 3 `fit` steps, or a jitted `stateless_call`'s loss, gradients
  and seed states;
- `recompute_batch_norm_<dist>`: the blocks with BatchNormalization, `fit`,
  with `same` (RECOMPUTE=0 under the distribution);
- `keras_hub_<dist>`: a tiny keras-hub `BertBackbone` classifier under
  `recompute.keras_hub.patch()` with RECOMPUTE=1 against one device unpatched
  with RECOMPUTE=0, 3 `fit` steps;
- `allreduce_counts`: the all-reduces of the compiled train step under
  `DataParallel` (`tests.helpers.hlo`) for plain Adam and `AccumOptimizer`
  k = 1, 4, 8: [every step, only inside a `cond`, elements reduced every step].

`dist`: "dp" is `DataParallel` over the 4 devices; "mp" is `ModelParallel` on
a 2 x 2 mesh ("batch", "model") whose `LayoutMap` shards the first Dense
kernel and bias (a block's "up", keras-hub's FFN intermediate kernel) over "model".

Limits: virtual CPU devices share one host's memory and XLA:CPU's collectives;
on GPUs the all-reduce is NCCL's, whose summation order may differ (the
tolerance stays float32 rounding).
"""

import os
import sys

DEVICES = 4
if __name__ == "__main__":  # not when a test imports the module for its constants
    _FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import recompute  # noqa: E402
from accum import AccumOptimizer  # noqa: E402
from recompute import recompute_grad, recompute_scope  # noqa: E402
from tests.helpers import hlo  # noqa: E402

K, B, MICRO_STEPS = 3, 8, 7  # global micro-batch B (divisible by 4 and by 2)
FEATURES, HIDDEN, OUTPUTS = 6, 16, 2


# ------------------------------------------------------------------ distributions

def distribution(kind):
    """"dp": DataParallel over every device; "mp": ModelParallel on a 2 x 2 mesh sharding
    the first Dense layer ("d1", or a block's "up") kernel and bias over "model"."""
    devices = jax.devices()
    if kind == "dp":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((2, DEVICES // 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*(d1|up)/kernel"] = (None, "model")
    layout_map[".*(d1|up)/bias"] = ("model",)
    layout_map[".*feedforward_intermediate_dense/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def in_scope(kind, fn):
    """`fn()` on one device (kind None) or in the distribution's scope."""
    if kind is None:
        return fn()
    with distribution(kind).scope():
        return fn()


def shard_batch(arrays):
    """Arrays laid out along the current distribution's batch axis (as Keras's trainer does)."""
    dist = keras.distribution.distribution()
    if dist is None:
        return arrays
    return [keras.distribution.distribute_tensor(a, dist.get_data_layout(a.shape)) for a in arrays]


def values(variables):
    return [np.asarray(v.numpy()) for v in variables]


def sharded(variables):
    """The paths of the variables laid out over the "model" axis (ModelParallel's LayoutMap)."""
    return [v.path for v in variables if "model" in tuple(getattr(v.value.sharding, "spec", ()))]


# ------------------------------------------------------------------------ accum

def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation="tanh", name="d1")(x)
    return keras.Model(x, keras.layers.Dense(OUTPUTS, name="d2")(h))


def mlp_data(n=MICRO_STEPS * B):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype("float32"), rng.normal(size=(n, OUTPUTS)).astype("float32")


def accum_optimizer(mode, k=K):
    if mode == "buffer":
        return AccumOptimizer(keras.optimizers.Adam(1e-2), k)
    return AccumOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), k, mode="rescale")


def accum_fit(mode):
    model = mlp()
    model.compile(accum_optimizer(mode), "mse")
    x, y = mlp_data()
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return model, model.optimizer


def accum_stateless(mode):
    """Micro-steps of a jitted `stateless_call` + `optimizer.stateless_apply` step."""
    model = mlp()
    optimizer = accum_optimizer(mode)
    optimizer.build(model.trainable_variables)
    x, y = mlp_data()

    @jax.jit
    def step(trainable, non_trainable, optimizer_values, xb, yb):
        def loss_fn(trainable):
            out, new_non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
            return keras.ops.mean((out - yb) ** 2), new_non_trainable

        (_, new_non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_values = optimizer.stateless_apply(optimizer_values, grads, trainable)
        return trainable, new_non_trainable, optimizer_values

    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    for i in range(MICRO_STEPS):
        state = step(*state, *shard_batch([x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]]))
    for variables, new in zip((model.trainable_variables, model.non_trainable_variables,
                               optimizer.variables), state):
        for variable, value in zip(variables, new):
            variable.assign(value)
    return model, optimizer


def accum_result(model_and_optimizer):
    """Weights, then every optimizer variable (counters, buffers, the inner slots)."""
    model, optimizer = model_and_optimizer
    names = [w.path for w in model.weights] + [v.path for v in optimizer.variables]
    return values(model.weights) + values(optimizer.variables), names


def accum_scenario(mode, kind, how):
    run = accum_fit if how == "fit" else accum_stateless
    ref, names = one_device(accum_run, run, mode)
    model, optimizer = in_scope(kind, lambda: run(mode))
    got, _ = accum_result((model, optimizer))
    return {"ref": ref, "got": got}, names, sharded(model.weights + optimizer.variables)


def accum_run(run, mode):
    return accum_result(run(mode))


# --------------------------------------------------------------------- recompute

class Block(keras.layers.Layer):
    """Dense-GELU, seeded dropout, an `add_loss`, a residual, recomputed; with `batch_norm`,
    a BatchNormalization after the dropout."""

    def __init__(self, seed=None, batch_norm=False, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(32, activation="gelu", name="up")
        self.drop = keras.layers.Dropout(0.3, seed=seed)
        self.norm = keras.layers.BatchNormalization() if batch_norm else None
        self.down = keras.layers.Dense(HIDDEN, name="down")

    @recompute_grad
    def call(self, x, training=None):
        h = self.drop(self.up(x), training=training)
        if self.norm is not None:
            h = self.norm(h, training=training)
        self.add_loss(1e-3 * keras.ops.mean(h ** 2))
        return x + self.down(h)


def blocks(seed=0, batch_norm=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((HIDDEN,))
    h = inputs
    for i in range(2):
        h = Block(seed=10 + i, batch_norm=batch_norm, name=f"block{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def block_data(n=3 * B):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, HIDDEN)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def recompute_fit(on, batch_norm=False):
    model = blocks(batch_norm=batch_norm)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    x, y = block_data()
    with recompute_scope(on):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return values(model.weights), [w.path for w in model.weights], sharded(model.weights)


def recompute_stateless(on):
    """Loss, gradients and new non-trainable values (seed states) of one jitted
    `stateless_call` under `jax.value_and_grad`."""
    model = blocks()
    x, y = block_data(B)
    xb, yb = shard_batch([x, y])

    @jax.jit
    def grads_of(trainable, non_trainable):
        def loss_fn(trainable):
            with recompute_scope(on):
                out, new_state, losses = model.stateless_call(
                    trainable, non_trainable, xb, training=True, return_losses=True)
            return keras.ops.mean((out - yb) ** 2) + sum(losses), new_state

        return jax.value_and_grad(loss_fn, has_aux=True)(trainable)

    (loss, new_state), grads = grads_of([v.value for v in model.trainable_variables],
                                        [v.value for v in model.non_trainable_variables])
    names = (["loss"] + [f"grad:{v.path}" for v in model.trainable_variables]
             + [v.path for v in model.non_trainable_variables])
    arrays = [np.asarray(loss)] + [np.asarray(g) for g in grads] + [np.asarray(s) for s in new_state]
    return arrays, names, sharded(model.weights)


def recompute_scenario(kind, how):
    run = recompute_fit if how == "fit" else recompute_stateless
    ref, names, _ = one_device(run, False)
    got, _, layout = in_scope(kind, lambda: run(True))
    return {"ref": ref, "got": got}, names, layout


def recompute_batch_norm_scenario(kind):
    """The block with BatchNormalization: `fit` under the distribution with RECOMPUTE=1
    (`got`) and RECOMPUTE=0 (`same`), and on one device with RECOMPUTE=0 (`ref`)."""
    ref, names, _ = one_device(recompute_fit, False, True)
    got, _, layout = in_scope(kind, lambda: recompute_fit(True, True))
    same, _, _ = in_scope(kind, lambda: recompute_fit(False, True))
    return {"ref": ref, "got": got, "same": same}, names, layout


def hub_fit(on):
    """3 `fit` steps of Adam of a tiny `BertBackbone` classifier (dropout 0.1, padding)."""
    import recompute.keras_hub
    from tests.helpers import keras_hub_checks as hub

    x, y = hub.batch(size=3 * B)
    model = hub.classifier(hub.tiny_backbone())
    if on:
        assert recompute.keras_hub.covered(model)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with recompute_scope(on):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return values(model.weights), [w.path for w in model.weights], sharded(model.weights)


def keras_hub_scenario(kind):
    """One device unpatched (RECOMPUTE=0) against `patch()` + RECOMPUTE=1 under the distribution."""
    import recompute.keras_hub

    ref, names, _ = one_device(hub_fit, False)
    recompute.keras_hub.patch()
    try:
        got, _, layout = in_scope(kind, lambda: hub_fit(True))
    finally:
        recompute.keras_hub.unpatch()
    return {"ref": ref, "got": got}, names, layout


# ------------------------------------------------ accum.local_gradients (one all-reduce per update)

def local_fit(micro_steps=MICRO_STEPS, model_fn=None, on=False, data_steps=MICRO_STEPS):
    """`AccumOptimizer(Adam, K)` under `accum.local_gradients`, `fit` over the first
    `micro_steps` global batches of B of the data of `data_steps` batches (the MLP's, or
    `model_fn()` on the blocks' data with RECOMPUTE `on`)."""
    import accum

    model = (model_fn or mlp)()
    model.compile(accum_optimizer("buffer"), "mse")
    accum.local_gradients(model)
    x, y = (block_data if model_fn else mlp_data)(data_steps * B)
    with recompute_scope(on):
        model.fit(x[:micro_steps * B], y[:micro_steps * B], batch_size=B, shuffle=False, verbose=0)
    return model, model.optimizer


def rows_summed(model_and_optimizer):
    """`accum_result`, each buffer with one row per device summed over its rows (what one
    device holds), and the layouts of the buffers (their sharding specs)."""
    model, optimizer = model_and_optimizer
    arrays, names = accum_result((model, optimizer))
    rows = {id(b): len(w.shape) for b, w in zip(optimizer.accumulators, model.trainable_variables)}
    arrays = [a.sum(0) if len(a.shape) == rows.get(id(v), -1) + 1 else a
              for a, v in zip(arrays, list(model.weights) + list(optimizer.variables))]
    specs = [str(tuple(b.value.sharding.spec)) for b in optimizer.accumulators]
    return arrays, names, specs


def local_scenario(kind):
    """One device's `accum_fit("buffer")` against `local_fit` under the distribution."""
    ref, names = one_device(accum_run, accum_fit, "buffer")
    got, _, specs = in_scope(kind, lambda: rows_summed(local_fit()))
    return {"ref": ref, "got": got}, names, specs


def local_resume_scenario():
    """`local_fit` on 4 devices (7 micro-steps: one pending), saved as `.keras`, loaded with
    no distribution, 2 more micro-steps; against one device's 9 micro-steps."""
    import tempfile

    def one():
        model = mlp()
        model.compile(accum_optimizer("buffer"), "mse")
        x, y = mlp_data((MICRO_STEPS + 2) * B)
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        return accum_result((model, model.optimizer))

    ref, names = one_device(one)
    model, _ = in_scope("dp", lambda: local_fit(data_steps=MICRO_STEPS + 2))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    x, y = mlp_data((MICRO_STEPS + 2) * B)
    loaded.fit(x[MICRO_STEPS * B:], y[MICRO_STEPS * B:], batch_size=B, shuffle=False, verbose=0)
    got, _ = accum_result((loaded, loaded.optimizer))
    return {"ref": ref, "got": got}, names, []


def local_mixed_scenario():
    """4 micro-steps of `fit` under `local_gradients`, then 3 of a jitted `stateless_call`
    step that hands `stateless_apply` gradients already reduced (they go to row 0);
    against one device's 7 micro-steps."""
    ref, names = one_device(accum_run, accum_fit, "buffer")

    def run():
        model, optimizer = local_fit(4)
        x, y = mlp_data()

        @jax.jit
        def step(trainable, non_trainable, optimizer_values, xb, yb):
            def loss_fn(trainable):
                out, _ = model.stateless_call(trainable, non_trainable, xb, training=True)
                return keras.ops.mean((out - yb) ** 2)

            grads = jax.grad(loss_fn)(trainable)
            return optimizer.stateless_apply(optimizer_values, grads, trainable)

        trainable = [v.value for v in model.trainable_variables]
        optimizer_values = [v.value for v in optimizer.variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        for i in range(4, MICRO_STEPS):
            trainable, optimizer_values = step(
                trainable, non_trainable, optimizer_values,
                *shard_batch([x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]]))
        for variable, value in zip(list(model.trainable_variables) + list(optimizer.variables),
                                   list(trainable) + list(optimizer_values)):
            variable.assign(value)
        return rows_summed((model, optimizer))

    got, _, specs = in_scope("dp", run)
    return {"ref": ref, "got": got}, names, specs


def local_dropout_scenario():
    """The recomputed dropout blocks under `local_gradients` (DataParallel): RECOMPUTE=1
    (`got`) against RECOMPUTE=0 (`same`), 3 micro-steps; `rows`: each device's row of the
    first block's kernel buffer after one micro-step whose four shards hold the same
    samples (the rows differ only through the devices' dropout masks); `seeds`: the seed
    states after the 3 micro-steps, and (`ref`) one device's after 3 steps of `fit`."""
    def arrays(on):
        model, optimizer = local_fit(3, blocks, on, data_steps=3)
        result, names, _ = rows_summed((model, optimizer))
        return result, names

    got, names = in_scope("dp", lambda: arrays(True))
    same, _ = in_scope("dp", lambda: arrays(False))

    def one_shard_repeated():
        import accum

        model = blocks()
        model.compile(accum_optimizer("buffer"), "mse")
        accum.local_gradients(model)
        x, y = block_data(B // DEVICES)
        model.fit(np.tile(x, (DEVICES, 1)), np.tile(y, (DEVICES, 1)), batch_size=B, verbose=0)
        return np.asarray(model.optimizer.accumulators[0].numpy())

    rows = in_scope("dp", one_shard_repeated)
    seeds_local = [np.asarray(v.numpy()) for v in in_scope("dp", lambda: local_fit(3, blocks, data_steps=3))[0].non_trainable_variables]

    def seeds_one_device():
        model = blocks()
        model.compile(accum_optimizer("buffer"), "mse")
        x, y = block_data(3 * B)
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        return [np.asarray(v.numpy()) for v in model.non_trainable_variables]

    runs = {"got": got, "same": same, "rows": [rows], "seeds": seeds_local, "ref": seeds_one_device()}
    return runs, names, []


_ONE_DEVICE = {}


def one_device(run, *args):
    """`run(*args)` with no distribution, computed once per process."""
    key = tuple(getattr(a, "__name__", a) for a in (run, *args))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = run(*args)
    return _ONE_DEVICE[key]


# -------------------------------------------------------------- all-reduce counts

def allreduce_counts():
    """{configuration: [all-reduce ops every step, ops only on update steps, float32
    elements all-reduced every step, elements all-reduced only on update steps]} of the
    compiled train step: under DataParallel plain Adam and `AccumOptimizer(Adam, k)`,
    k = 1, 4, 8 (`accum_k<k>`), and the same under `accum.local_gradients`
    (`local_dp_k<k>`; `local_mp_k<k>` under ModelParallel)."""
    import accum

    x, y = mlp_data(B)
    configurations = [("adam", "dp", lambda: keras.optimizers.Adam(1e-2), False)]
    for k in (1, 4, 8):
        make = lambda k=k: AccumOptimizer(keras.optimizers.Adam(1e-2), k)  # noqa: E731
        configurations += [(f"accum_k{k}", "dp", make, False), (f"local_dp_k{k}", "dp", make, True),
                           (f"local_mp_k{k}", "mp", make, True)]
    counts = {}
    for label, kind, make, local in configurations:
        with distribution(kind).scope():
            model = mlp()
            model.compile(make(), "mse")
            if local:
                accum.local_gradients(model)
            text = hlo.compiled_train_step_text(model, x, y)
        ops = hlo.all_reduces(text)
        every = [op for op in ops if not op.conditional]
        updates = [op for op in ops if op.conditional]
        counts[label] = [len(every), len(updates), sum(op.elements for op in every if op.floats),
                         sum(op.elements for op in updates)]
    return counts


# ---------------------------------------------------------------------- driver

SCENARIOS = {}
for _kind in ("dp", "mp"):
    for _mode in ("buffer", "rescale"):
        for _how in ("fit", "stateless"):
            SCENARIOS[f"accum_{_mode}_{_kind}_{_how}"] = (
                lambda m=_mode, d=_kind, h=_how: accum_scenario(m, d, h))
    for _how in ("fit", "stateless"):
        SCENARIOS[f"recompute_{_kind}_{_how}"] = lambda d=_kind, h=_how: recompute_scenario(d, h)
    SCENARIOS[f"recompute_batch_norm_{_kind}"] = lambda d=_kind: recompute_batch_norm_scenario(d)
    SCENARIOS[f"keras_hub_{_kind}"] = lambda d=_kind: keras_hub_scenario(d)
    SCENARIOS[f"local_{_kind}_fit"] = lambda d=_kind: local_scenario(d)
SCENARIOS["local_dp_resume"] = local_resume_scenario
SCENARIOS["local_dp_mixed"] = local_mixed_scenario
SCENARIOS["local_dp_dropout"] = local_dropout_scenario


def main(out_dir, names):
    """Runs the scenarios `names` (all, and the all-reduce counts, if empty); writes their npz."""
    import time

    recompute.exact_float32()
    assert len(jax.devices()) == DEVICES, jax.devices()
    for name in names or list(SCENARIOS) + ["allreduce_counts"]:
        start = time.perf_counter()
        path = os.path.join(out_dir, f"{name}.npz")
        if name == "allreduce_counts":
            counts = allreduce_counts()
            np.savez(path, labels=np.array(list(counts)), counts=np.array(list(counts.values())))
        else:
            runs, labels, layout = SCENARIOS[name]()
            np.savez(path, names=np.array(labels), sharded=np.array(layout, dtype=str), **{
                f"{run}_{i}": a for run, arrays in runs.items() for i, a in enumerate(arrays)})
        print(f"done {name} in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
