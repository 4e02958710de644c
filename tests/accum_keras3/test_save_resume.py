"""Keras 3: a model compiled with `AccumOptimizer`, saved mid-window (7 micro-steps, k=4),
loads in a fresh process (`import accum` only) and finishes bit-exactly like the
uninterrupted run: `.keras` (`load_model`) and `.weights.h5` (`load_weights` into a
freshly built model and optimizer), for Sequential, functional and subclassed models.
The worker is `tests/save_resume_worker.py` (one process for every case)."""

import numpy as np
import pytest

from tests.helpers import save_resume_worker as worker

KINDS = ("sequential", "functional", "subclassed")
PLAN = {("adam", kind): ["keras", "weights"] for kind in KINDS}
PLAN[("momentum", "sequential")] = ["keras"]
PLAN[("rescale", "functional")] = ["keras", "weights"]
CASES = [(spec, kind, fmt) for (spec, kind), formats in PLAN.items() for fmt in formats]


@pytest.fixture(scope="module")
def saved_and_resumed(tmp_path_factory):
    return worker.run_plan("keras", PLAN, str(tmp_path_factory.mktemp("save_resume")))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_resume_in_fresh_process_is_bit_exact(saved_and_resumed, case):
    cases, result = saved_and_resumed
    saved = cases[case][0]
    assert saved["counters"] == [worker.STOP, 1, worker.STOP - worker.K]  # mid-window
    if case[0] == "adam":  # the pending window is in the buffers
        assert any(np.any(v != 0) for v in saved["optimizer"][4:4 + len(saved["weights"])])
    worker.check_case(cases, result, case)


def test_import_accum_does_not_import_tf_keras(saved_and_resumed):
    _, result = saved_and_resumed
    assert result["tf_keras_imported"] is False
