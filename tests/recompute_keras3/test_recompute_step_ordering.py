"""Keras 3 (TensorFlow backend): the recomputation's weight reads run before the optimizer's
writes of those weights (tests/helpers/step_ordering.py says what raced and why)."""

import keras
import pytest

from tests.helpers import step_ordering


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_step_graph_orders_every_variable(on):
    step_ordering.check_step_graph_orders_every_variable(keras, on)


@pytest.mark.slow
def test_late_reads_match_reference():
    step_ordering.check_late_reads_match_reference(keras)
