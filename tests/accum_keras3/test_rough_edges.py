"""Keras 3: refusals at the earliest point (k bound, read-only `steps_per_update`, an
inner optimizer that accumulates itself or is shared, `local_gradients` off JAX) and
unfreezing."""

import keras
import numpy as np
import pytest

from accum import AccumOptimizer


@pytest.mark.parametrize("k", [2**63, 2**64, np.uint64(2**63)])
def test_steps_per_update_beyond_int64_refused(k):
    with pytest.raises(ValueError, match=r"`steps_per_update` must be an integer >= 1 and <= 2\*\*63 - 1 \(the window counters are int64\)\. Received: steps_per_update="):
        AccumOptimizer(keras.optimizers.SGD(), k)


def test_largest_steps_per_update_accepted():
    opt = AccumOptimizer(keras.optimizers.SGD(), 2**63 - 1)
    v = keras.Variable(np.ones(2, "float32"))
    opt.apply_gradients([(np.ones(2, "float32"), v)])
    assert int(opt.micro_steps) == 1 and int(opt.iterations) == 0


def test_steps_per_update_read_only():
    opt = AccumOptimizer(keras.optimizers.SGD(), 4)
    with pytest.raises(AttributeError, match=r"`steps_per_update` is read-only.*build a new `AccumOptimizer`.*Received: steps_per_update=8"):
        opt.steps_per_update = 8
    assert opt.steps_per_update == 4 and opt.get_config()["steps_per_update"] == 4


def test_steps_per_update_read_only_after_fit():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), 2)
    model.compile(opt, "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0)
    with pytest.raises(AttributeError, match="read-only"):
        opt.steps_per_update = 4
    assert int(opt.iterations) == 2


@pytest.mark.parametrize("wrap_lso", [False, True])
def test_inner_gradient_accumulation_steps_refused(wrap_lso):
    inner = keras.optimizers.Adam(gradient_accumulation_steps=4)
    if wrap_lso:
        inner = keras.optimizers.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match=r"`optimizer` already accumulates gradients \(gradient_accumulation_steps=4\);.*steps_per_update=4"):
        AccumOptimizer(inner, 2)


def test_shared_inner_refused():
    inner = keras.optimizers.Adam()
    first = AccumOptimizer(inner, 2)
    with pytest.raises(ValueError, match=r"`optimizer` is already wrapped by another `AccumOptimizer`"):
        AccumOptimizer(inner, 4)
    with pytest.raises(ValueError, match="already wrapped by another"):
        AccumOptimizer(keras.optimizers.LossScaleOptimizer(inner), 4)
    assert first.inner_optimizer is inner


def test_inner_released_when_wrapper_is_gone():
    import gc

    inner = keras.optimizers.Adam()
    AccumOptimizer(inner, 2)
    gc.collect()
    assert AccumOptimizer(inner, 4).steps_per_update == 4


def test_unfreeze_refused_like_plain():
    """Keras 3 optimizers are built once for a fixed variable list: plain Adam refuses a
    variable unfrozen later, and so does the wrapper, with the same error."""
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    messages = []
    for optimizer in (keras.optimizers.Adam(), AccumOptimizer(keras.optimizers.Adam(), 2)):
        keras.utils.set_random_seed(0)
        body = keras.layers.Dense(4)
        model = keras.Sequential([keras.Input((3,)), body, keras.layers.Dense(1)])
        body.trainable = False
        model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=2, verbose=0)
        body.trainable = True
        model.compile(optimizer, "mse")
        with pytest.raises(ValueError, match="Unknown variable") as info:
            model.fit(x, y, batch_size=2, verbose=0)
        messages.append(str(info.value).split(".")[1])
    assert messages[0] == messages[1]


def test_local_gradients_refused_on_tensorflow():
    """`accum.local_gradients` is JAX's; TensorFlow reduces once per update already."""
    import accum

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(AccumOptimizer(keras.optimizers.SGD(), 2), "mse")
    with pytest.raises(ValueError, match=r"needs the JAX backend.*Received: backend='tensorflow'"):
        accum.local_gradients(model)
