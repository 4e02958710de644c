"""recompute_grad on Keras 3: rough edges (non-tensor outputs, misuse caught early, reload):
the checks of tests/helpers/recompute_edge_checks.py."""

from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.recompute_edge_checks import (  # noqa: F401 (collected here)
    test_bound_call_decoration_reapplied_after_load,
    test_dropout_created_in_call_gets_advice_that_can_be_followed,
    test_errors_describe_tensors_without_their_values,
    test_non_tensor_outputs_in_fit,
    test_non_tensor_outputs_pass_through,
    test_only_non_float_outputs,
    test_staticmethod_or_plain_function_refused_at_decoration,
    test_unconnected_gradients_are_none,
    test_unconnected_weights_under_weight_decay_fit_matches,
)
