"""The save/resume tests' plan and checks, written once for the three suites
(tests/accum_keras3/test_save_resume.py, tests/accum_tf_keras/test_save_resume.py,
tests/accum_jax/test_accum_jax.py): a plan `{(spec, kind): [format, ...]}` runs in one
fresh worker process (tests.helpers.save_resume_worker); each case is saved mid-window
and finishes bit-exactly like the uninterrupted run."""

import numpy as np
import pytest

from tests.helpers import save_resume_worker as worker


def cases(plan):
    """The plan's `(spec, kind, format)` cases."""
    return [(spec, kind, fmt) for (spec, kind), formats in plan.items() for fmt in formats]


def ids(listed):
    return ["-".join(c) for c in listed]


def saved_and_resumed_fixture(lib, plan, folder="save_resume"):
    """The module fixture `saved_and_resumed`: (cases, result) of `plan` run for `lib`
    ("keras" or "tf_keras")."""

    @pytest.fixture(scope="module", name="saved_and_resumed")
    def saved_and_resumed(tmp_path_factory):
        return worker.run_plan(lib, plan, str(tmp_path_factory.mktemp(folder)))

    return saved_and_resumed


def check_resumed_mid_window(saved_and_resumed, case, buffers_at=None):
    """The case was saved mid-window (its counters); with `buffers_at` (the index of the
    first accumulation buffer among the optimizer's saved variables) the pending window
    is in the buffers; the resumed run finished bit-exactly."""
    cases_, result = saved_and_resumed
    saved = cases_[case][0]
    assert saved["counters"] == [worker.STOP, 1, worker.STOP - worker.K]  # mid-window
    if buffers_at is not None:
        assert any(np.any(v != 0) for v in saved["optimizer"][buffers_at:buffers_at + len(saved["weights"])])
    worker.check_case(cases_, result, case)
