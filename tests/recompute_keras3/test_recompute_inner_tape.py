"""recompute_grad on Keras 3: calls that open their own GradientTape (D4) and RNN cells (D6):
the checks of tests/helpers/recompute_inner_tape_checks.py."""

from tests.helpers.families import keras3  # noqa: F401 (the fixture K)
from tests.helpers.recompute_inner_tape_checks import (  # noqa: F401 (collected here)
    test_decorated_cell_in_while_loop_raises_in_graph,
    test_inner_tape_eager_raises_and_graph_is_exact,
    test_inner_tape_fit_matches,
    test_inner_tape_fit_run_eagerly_raises,
    test_inner_tape_forces_and_gradients_match,
    test_inner_tape_under_another_name_gets_a_hint,
    test_lambda_without_tape_runs_eagerly,
    test_rnn_alternatives_match,
)
