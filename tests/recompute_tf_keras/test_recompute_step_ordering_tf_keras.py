"""tf_keras: the recomputation's weight reads run before the optimizer's writes of those
weights (tests/helpers/step_ordering.py says what raced and why)."""

import pytest
import tf_keras

from tests.helpers import step_ordering


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable dropout (tf.random.Generator), as a user seeking RECOMPUTE=0's numbers runs."""
    tf_keras.backend.experimental.enable_tf_random_generator()
    yield


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_step_graph_orders_every_variable(on):
    step_ordering.check_step_graph_orders_every_variable(tf_keras, on)


@pytest.mark.slow
def test_late_reads_match_reference():
    step_ordering.check_late_reads_match_reference(tf_keras)
