"""Keras 3 on the JAX backend: the checks of tests/helpers/accum_family_checks.py (not
`mode="momentum"`, which is TensorFlow only), and the int32 counters of JAX without x64."""

import warnings

import jax
import keras
import numpy as np
import pytest

from accum import AccumOptimizer
from tests.helpers.accum_family_checks import *  # noqa: F403 (the checks, collected here)
from tests.helpers.accum_family_checks import keras3_family  # noqa: F401 (the fixture family)


@pytest.mark.skipif(jax.dtypes.canonicalize_dtype(np.int64) == np.int64, reason="jax_enable_x64 is on")
def test_steps_per_update_beyond_int32_refused_without_x64():
    """Without `jax_enable_x64` the int64 counters hold int32: k = 2**31 is refused at
    construction (it used to fail at the end of `fit`); 2**31 - 1 trains."""
    with pytest.raises(ValueError, match=r"`steps_per_update` must be an integer >= 1 and <= 2\*\*31 - 1 "
                       r"on the JAX backend.*jax_enable_x64.*Received: steps_per_update=2147483648"):
        AccumOptimizer(keras.optimizers.Adam(), 2**31)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = AccumOptimizer(keras.optimizers.Adam(), 2**31 - 1)
    model.compile(opt, "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int64 truncated to int32; the pending-window warning
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), batch_size=1, verbose=0)
    assert int(opt.micro_steps.numpy()) == 4 and int(opt.window_steps.numpy()) == 4
    assert int(opt.iterations.numpy()) == 0
