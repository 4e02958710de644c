"""Keras 3 (TensorFlow backend): the checks of tests/helpers/accum_family_checks.py."""

from tests.helpers.accum_family_checks import (  # noqa: F401 (collected here)
    keras3_family,
    test_compiling_again_with_pending_micro_steps_warns,
    test_momentum_flush_is_refused_and_the_window_is_carried_exactly,
    test_rescale_at_the_largest_k_moves_the_weights_like_buffer,
    test_rescale_checks_the_variables_dtype_when_built,
    test_rescale_non_finite_micro_step_counts_as_zero_wherever_it_is,
    test_rescale_refuses_a_k_its_coefficients_cannot_hold_in_float32,
    test_rescale_refuses_a_loss_scale_optimizer_inside_and_points_outside,
    test_rescale_warns_about_the_last_micro_gradient_only_when_k_is_above_1,
)
