"""`accum.local_gradients` on 4 virtual CPU devices, in a process of its own
(tests/accum_jax/test_local_gradients_devices_jax.py runs it): what a pytest process,
with JAX initialized on one device, cannot show -- batches that do not split over
the shards, and loss scaling with several shards.

`python -m tests.helpers.local_gradients_worker OUT.json [CHECK ...]` runs each check
(all of `CHECKS` by default) and writes `{check: result}`: what the check returned (JSON),
or `{"error": type, "message": str}` for what it raised. The test asserts on them.
"""

import json
import os
import sys

DEVICES = 4
if __name__ == "__main__":
    _FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import accum  # noqa: E402
from accum import AccumOptimizer  # noqa: E402
from tests.helpers.local_gradients_models import data, data_parallel, mlp  # noqa: E402

B = 8


def compiled(local, optimizer=None):
    model = mlp()
    model.compile(optimizer or AccumOptimizer(keras.optimizers.Adam(1e-2), 3), "mse")
    if local:
        accum.local_gradients(model)
    return model


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def largest_difference(a, b):
    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)) for x, y in zip(a, b))


def trained(model, before):
    return largest_difference(weights(model), before) > 0


# ---------------------------------------------------------------- checks

def batch_size_not_a_multiple():
    """`fit(batch_size=6)` on 4 shards: refused before any step."""
    x, y = data(24)
    with data_parallel().scope():
        model = compiled(True)
        before = weights(model)
        try:
            model.fit(x, y, batch_size=6, verbose=0)
        except ValueError as error:
            raise ValueError(f"trained={trained(model, before)}: {error}") from None


def last_batch_not_a_multiple():
    """18 samples in batches of 8: the epoch's last batch holds 2; refused before any step."""
    x, y = data(18)
    with data_parallel().scope():
        model = compiled(True)
        before = weights(model)
        try:
            model.fit(x, y, batch_size=B, verbose=0)
        except ValueError as error:
            raise ValueError(f"trained={trained(model, before)}: {error}") from None


def last_batch_of_a_dataset():
    """A `tf.data.Dataset` of 18 samples batched by 8: the first two batches train, the last
    (2 samples) is refused with what to do."""
    import tensorflow as tf

    x, y = data(18)
    with data_parallel().scope():
        model = compiled(True)
        before = weights(model)
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), verbose=0)
        except ValueError as error:
            micro_steps = int(model.optimizer.micro_steps.numpy())
            raise ValueError(f"trained={trained(model, before)} micro_steps={micro_steps}: {error}") from None


def train_on_batch_not_a_multiple():
    x, y = data(6)
    with data_parallel().scope():
        compiled(True).train_on_batch(x, y)


def mixed_float16_matches_keras_step():
    """`mixed_float16` (Keras wraps the AccumOptimizer in a LossScaleOptimizer): the local
    step's weights, loss scale and counters against Keras's step's, 4 shards, 2 updates."""
    x, y = data(6 * B)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        results = []
        for local in (False, True):
            with data_parallel().scope():
                model = compiled(local)
                model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
            optimizer = model.optimizer
            results.append((weights(model), float(optimizer.dynamic_scale.numpy()),
                            int(optimizer.iterations.numpy()),
                            int(optimizer.inner_optimizer.micro_steps.numpy()),
                            [tuple(b.shape) for b in optimizer.inner_optimizer.accumulators]))
    finally:
        keras.config.set_dtype_policy("float32")
    (keras_weights, *keras_state), (local_weights, *local_state) = results
    return {"difference": largest_difference(local_weights, keras_weights),
            "keras": keras_state, "local": local_state}


def outside_the_scope():
    """Built and compiled in the scope, `local_gradients` outside it: the error names the
    scope and the mesh the model's variables lie on."""
    with data_parallel().scope():
        model = compiled(False)
    accum.local_gradients(model)


CHECKS = {f.__name__: f for f in (
    batch_size_not_a_multiple, last_batch_not_a_multiple, last_batch_of_a_dataset,
    train_on_batch_not_a_multiple, mixed_float16_matches_keras_step, outside_the_scope)}


def main(out_path, names):
    assert len(jax.devices()) == DEVICES, jax.devices()
    results = {}
    for name in names or list(CHECKS):
        try:
            results[name] = CHECKS[name]()
        except Exception as error:  # the test reads what was raised
            results[name] = {"error": type(error).__name__, "message": str(error)}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
