"""`accum.local_gradients` in this process (one CPU device: a batch axis of one shard):
what it refuses, with the reason, and that it trains exactly as Keras's step does. Several devices, the exactness against one device and the all-reduce counts:
tests/accum_jax/test_distribution_jax.py."""

import jax
import keras
import numpy as np
import pytest

import accum
from accum import AccumOptimizer
from tests.helpers.local_gradients_models import data, data_parallel, mlp
from tests.helpers.numerics import assert_all_close

B = 4


def compiled(model, optimizer=None, loss="mse", **kwargs):
    model.compile(optimizer or AccumOptimizer(keras.optimizers.Adam(1e-2), 3), loss, **kwargs)
    return model


@pytest.mark.parametrize("local", [False, True])
def test_one_shard_trains_as_keras_step(local):
    """`local_gradients` trains to Keras's own step's weights and optimizer state (with
    one shard, the buffers' single row is the buffer)."""
    x, y = data(7 * B)
    with data_parallel().scope():
        reference = compiled(mlp())
        reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        model = compiled(mlp())
        if local:
            assert accum.local_gradients(model) is model
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)
    store, reference_store = {}, {}
    model.optimizer.save_own_variables(store)
    reference.optimizer.save_own_variables(reference_store)
    assert store.keys() == reference_store.keys()
    assert_all_close([reference_store[k] for k in store], [store[k] for k in store], list(store), rtol=1e-6)
    if local:
        shapes = [(tuple(b.shape), tuple(w.shape)) for b, w in
                  zip(model.optimizer.accumulators, model.trainable_variables)]
        shards = len(jax.devices())  # one here, unless XLA_FLAGS gave this process more
        assert all(b == (shards, *w) for b, w in shapes), shapes


def test_refuses_without_distribution():
    with pytest.raises(ValueError, match="needs a `keras.distribution` with a batch axis"):
        accum.local_gradients(compiled(mlp()))


@pytest.mark.parametrize("optimizer, match", [
    (None, "Compile the model first"),
    (keras.optimizers.Adam(), "Received: optimizer=<keras.src.optimizers.adam.Adam"),
    (AccumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), 2, mode="rescale"), 'mode="rescale"'),
])
def test_refuses_without_buffered_accum_optimizer(optimizer, match):
    with data_parallel().scope():
        model = mlp() if optimizer is None else compiled(mlp(), optimizer)
        with pytest.raises(ValueError, match=match):
            accum.local_gradients(model)


def test_refuses_a_loss_that_is_not_a_mean():
    with data_parallel().scope():
        model = compiled(mlp(), loss=keras.losses.MeanSquaredError(reduction="sum"))
        with pytest.raises(ValueError, match="reduction='sum'"):
            accum.local_gradients(model)


def test_refuses_eager_steps():
    with data_parallel().scope():
        model = compiled(mlp(), run_eagerly=True)
        with pytest.raises(ValueError, match="run_eagerly=True"):
            accum.local_gradients(model)


def test_refuses_batch_normalization_at_the_first_step():
    """A layer that updates non-trainable state from the batch: refused when traced."""
    x, y = data(3 * B)
    with data_parallel().scope():
        model = accum.local_gradients(compiled(mlp(keras.layers.BatchNormalization())))
        with pytest.raises(ValueError, match="batch_normalization.*moving_mean|moving_mean"):
            model.fit(x, y, batch_size=B, verbose=0)


def test_refuses_masked_predictions():
    """A prediction with a Keras mask (the loss would average each shard's unmasked entries)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
    model = None
    with data_parallel().scope():
        model = keras.Model(tokens, keras.layers.Dense(2)(h))
        accum.local_gradients(compiled(model))
        x = np.random.default_rng(0).integers(0, 10, size=(B, 6)).astype("int32")
        y = np.zeros((B, 6, 2), "float32")
        with pytest.raises(ValueError, match="with a mask"):
            model.fit(x, y, batch_size=B, verbose=0)
