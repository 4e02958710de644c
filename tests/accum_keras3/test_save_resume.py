"""Keras 3: a model compiled with `AccumOptimizer`, saved mid-window (7 micro-steps, k=4),
loads in a fresh process (`import accum` only) and finishes bit-exactly like the
uninterrupted run: `.keras` (`load_model`) and `.weights.h5` (`load_weights` into a
freshly built model and optimizer), for Sequential, functional and subclassed models.
The worker is `tests/save_resume_worker.py` (one process for every case)."""

import pytest

from tests.helpers import save_resume_checks as checks

KINDS = ("sequential", "functional", "subclassed")
PLAN = {("adam", kind): ["keras", "weights"] for kind in KINDS}
PLAN[("momentum", "sequential")] = ["keras"]
PLAN[("rescale", "functional")] = ["keras", "weights"]
CASES = checks.cases(PLAN)
saved_and_resumed = checks.saved_and_resumed_fixture("keras", PLAN)


@pytest.mark.parametrize("case", CASES, ids=checks.ids(CASES))
def test_resume_in_fresh_process_is_bit_exact(saved_and_resumed, case):
    # adam: the pending window is in the buffers (after 4 counters)
    checks.check_resumed_mid_window(saved_and_resumed, case, buffers_at=4 if case[0] == "adam" else None)


def test_import_accum_does_not_import_tf_keras(saved_and_resumed):
    _, result = saved_and_resumed
    assert result["tf_keras_imported"] is False
