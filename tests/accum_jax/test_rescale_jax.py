"""`mode="rescale"` on Keras 3's JAX backend: through Keras's JAX trainer (`stateless_apply`,
`jit`), the same recipe as on TensorFlow (`accum.keras3._rescale_step` is written in `keras.ops`)."""

import keras
import numpy as np
import pytest

from accum import AccumOptimizer
from tests.helpers.numerics import assert_all_close
from tests.helpers.rescale_reference import OPTIMIZERS, rescaled_config, run_recipe

K, B, WINDOWS = 4, 3, 3
CASES = [c for c in OPTIMIZERS if c[0] in ("Adam", "Nadam", "SGD", "RMSprop")]


def make_data(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def twin(model):
    other = make_model()
    other.set_weights(model.get_weights())
    return other


@pytest.mark.parametrize("jit_compile", [True, False])
@pytest.mark.parametrize("name,kwargs,coefficients,heavy_ball", CASES, ids=[c[0] for c in CASES])
def test_rescale_is_the_recipe(name, kwargs, coefficients, heavy_ball, jit_compile):
    x, y = make_data(K * B * WINDOWS)
    model = make_model()
    ref = twin(model)
    inner = getattr(keras.optimizers, name)(**kwargs)
    opt = AccumOptimizer(inner, K, mode="rescale")
    model.compile(opt, "mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    ref_opt = inner.__class__.from_config(rescaled_config(inner, K, coefficients, heavy_ball))
    ref.compile(ref_opt, "mse", jit_compile=jit_compile)
    micro = [(x[i:i + B], y[i:i + B]) for i in range(0, len(x), B)]
    run_recipe(ref, ref_opt, lambda xb, yb: ref.train_on_batch(xb, yb), micro, K)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=2e-5)
    assert int(inner.iterations.numpy()) == WINDOWS and int(opt.micro_steps.numpy()) == K * WINDOWS


def test_k1_is_the_inner_optimizer():
    x, y = make_data(B * 6)
    model = make_model()
    ref = twin(model)
    model.compile(AccumOptimizer(keras.optimizers.Nadam(1e-2), 1, mode="rescale"), "mse")
    ref.compile(keras.optimizers.Nadam(1e-2), "mse")
    for m in (model, ref):
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_all_close(ref.get_weights(), model.get_weights(), rtol=1e-6)


def test_accum_batch_normalization_is_refused_on_jax():
    """The window statistics are updated by the optimizer, which on JAX cannot assign the
    model's non-trainable variables: refused when the optimizer is built, naming the layer."""
    import accum

    model = keras.Sequential([keras.Input((5,)), accum.BatchNormalization(name="bn"), keras.layers.Dense(1)])
    opt = AccumOptimizer(keras.optimizers.Adam(), K)
    with pytest.raises(NotImplementedError, match=r"TensorFlow backend only.*\['bn'\]"):
        opt.build(model.trainable_variables)
