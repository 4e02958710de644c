"""recompute_grad on tf_keras: rough edges (non-tensor outputs, misuse caught early, RNG advice):
the checks of tests/helpers/recompute_edge_checks.py.

Runs in the tf_keras pytest process (see README).
"""

import pytest
import tf_keras as keras

from tests.helpers.families import tf_keras  # noqa: F401 (the fixture K)
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


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG (tf.random.Generator): dropout masks equal those of RECOMPUTE=0."""
    keras.backend.experimental.enable_tf_random_generator()
    yield
    keras.backend.experimental.enable_tf_random_generator()
