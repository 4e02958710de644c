"""benchmarks.batchfit measured: the command on the tiny shape plans with `recompute.plan` in
its process and writes the report, the JSON and the plot (own process: TF_KERAS=1
TF_USE_LEGACY_KERAS=1). The command runs in a fresh process, as users run it: its plan
measures the process's peak resident memory, which a test worker's earlier tests would
have raised above the budget."""

import json
import os

import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

from tests.helpers.commands import run_module  # noqa: E402

pytestmark = pytest.mark.slow  # real training steps of a tiny BERT: about 40 s on 2 cores


def test_command_plans_the_tiny_shape(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    run = run_module("benchmarks.batchfit", "--models", "tiny", "--seq-len", "32",
                     "--budget-gib", "1", "--effective-batch", "8", "--policies", "block",
                     "--json", str(out), "--plot", str(png), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout
    assert "tiny:" in report and "Chosen: policy" in report and "planned in" in report
    (result,) = json.loads(out.read_text())["results"]
    plan = result["plan"]
    assert plan["micro_batch"] * plan["steps_per_update"] == 8
    assert plan["measured_peak_gib"] <= plan["budget_gib"] == 1
    assert [c["policy"] for c in plan["candidates"]] == [None, "block"]
    assert result["wall_s"] > 0 and result["cpu_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
