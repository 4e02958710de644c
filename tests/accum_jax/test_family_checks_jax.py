"""Keras 3 on the JAX backend: the checks of tests/helpers/accum_family_checks.py (not
`mode="momentum"`, which is TensorFlow only), and the int32 counters of JAX without x64."""

import warnings

import jax
import keras
import numpy as np
import pytest

from accum import AccumOptimizer
from tests.helpers.accum_family_checks import (  # noqa: F401 (collected here)
    keras3_family,
    test_compiling_again_with_pending_micro_steps_warns,
    test_rescale_at_the_largest_k_moves_the_weights_like_buffer,
    test_rescale_checks_the_variables_dtype_when_built,
    test_rescale_non_finite_micro_step_counts_as_zero_wherever_it_is,
    test_rescale_refuses_a_k_its_coefficients_cannot_hold_in_float32,
    test_rescale_refuses_a_loss_scale_optimizer_inside_and_points_outside,
    test_rescale_warns_about_the_last_micro_gradient_only_when_k_is_above_1,
)


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
