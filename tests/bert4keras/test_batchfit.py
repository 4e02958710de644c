"""benchmarks.batchfit without measuring: the call of `recompute.plan`, the report and plot,
the command line, and --quick's fine-tuning demo (own process: TF_KERAS=1
TF_USE_LEGACY_KERAS=1)."""

import os
import subprocess
import sys

import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

from benchmarks import batchfit  # noqa: E402  (does not import bert4keras)
from tests.helpers.commands import run_module  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(policies=(None, "attention", "block")):
    """A `recompute.Plan` as the planner records one: None fits 12 (16 refused), "attention"
    fits 32 (64 refused), "block" not checked (its estimate is slower)."""
    from recompute import planner

    gib = 1024.0 ** 3
    none = planner.Candidate(None, points={2: (0.9 * gib, 0.8), 4: (1.1 * gib, 1.6),
                                           12: (1.4 * gib, 4.8), 16: (1.7 * gib, 6.4)},
                             intercept=0.7 * gib, slope=0.1 * gib, predicted_batch=12,
                             micro_batch=12, refused_batch=16, checked=True)
    attention = planner.Candidate("attention", points={2: (0.8 * gib, 0.7), 4: (0.9 * gib, 1.4),
                                                       32: (1.45 * gib, 11.2),
                                                       64: (2.2 * gib, 22.4)},
                                  intercept=0.7 * gib, slope=0.05 * gib, predicted_batch=32,
                                  micro_batch=32, refused_batch=64, checked=True)
    block = planner.Candidate("block", points={2: (0.75 * gib, 1.5), 4: (0.8 * gib, 3.0)},
                              intercept=0.7 * gib, slope=0.025 * gib, predicted_batch=64,
                              estimated_seconds_per_sample=0.75,
                              error="not checked: its estimate is slower")
    cands = [c for c in (none, attention, block) if c.policy in policies]
    return planner.Plan(policy="attention", micro_batch=32, steps_per_update=2,
                        effective_batch=64, predicted_peak=1.45 * gib, measured_peak=1.45 * gib,
                        seconds_per_sample=0.35, budget=1.5 * gib,
                        memory="TensorFlow's CPU:0 allocator peak", candidates=cands,
                        seconds=12.0, clock="CPU s")


def test_the_choice_is_recompute_plans(monkeypatch):
    """batchfit does not search: it calls `recompute.plan` with its model builder, the
    policies (None first), the effective batch, the budget and the line's micro-batches."""
    import recompute

    calls = []

    def fake_plan(build_model, x, y, effective_batch, budget_gib, **kwargs):
        calls.append((build_model, x, y, effective_batch, budget_gib, kwargs))
        return _plan()

    monkeypatch.setattr(recompute, "plan", fake_plan)
    opts = dict(seq_len=32, effective_batch=64, budget_gib=1.5, policies=("attention", "block"),
                batches=(2, 4), memory="auto")
    result = batchfit.plan_model("tiny", opts)
    (build_model, x, y, effective, budget, kwargs), = calls
    assert callable(build_model) and (effective, budget) == (64, 1.5)
    assert kwargs == dict(policies=(None, "attention", "block"), batches=(2, 4), memory="auto")
    assert [a.shape for a in x] == [(4, 32), (4, 32)] and y.shape == (4,)
    assert result["plan"].policy == "attention" and result["wall_s"] >= 0


@pytest.mark.parametrize("argv, message", [
    (["--models", "base,huge"], "--models: expected a comma-separated list of distinct names "
                                "from base,large,minilm,tiny, got 'base,huge'"),
    (["--seq-len", "0"], "--seq-len: expected a positive integer, got '0'"),
    (["--budget-gib", "-2"], "--budget-gib: expected a positive number, got '-2'"),
    (["--budget-gib", "lots"], "--budget-gib: expected a positive number, got 'lots'"),
    (["--effective-batch", "1.5"], "--effective-batch/--max-batch: expected a positive integer, "
                                   "got '1.5'"),
    (["--batches", "4,4"], "--batches: expected distinct values, got '4,4'"),
    (["--batches", "2,4,8"], "--batches: expected two different positive integers such as 2,4, "
                             "got '2,4,8'"),
    (["--effective-batch", "1", "--batches", "2,4"], "--effective-batch: expected at least the "
                                                     "smallest of --batches (2, 4), got 1"),
    (["--plot", "out.jpg"], "--plot: expected a path ending in .png, got 'out.jpg'"),
    (["--json", "/no/such/dir/x.json"], "--json: directory '/no/such/dir' does not exist"),
])
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        batchfit.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line_error_exit_code():
    out = run_module("benchmarks.batchfit", "--max-batch", "zero")
    assert out.returncode == 2
    assert "--max-batch: expected a positive integer, got 'zero'" in out.stderr


def test_quick_demo_data_is_the_shared_data_or_the_embedded_sentences(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bert_finetune_example", batchfit.EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    shared = tmp_path / "rt-polarity"
    tsv = batchfit.demo_data(str(tmp_path), shared=str(shared))  # absent: the embedded sentences
    texts, labels = example.load_data(tsv)
    assert list(zip(texts, labels)) == list(batchfit.SENTENCES) and set(labels) == {0, 1}
    shared.mkdir()
    assert batchfit.demo_data(str(tmp_path), shared=str(shared)) == str(shared)


@pytest.mark.slow(seconds=140)
def test_quick_ends_with_the_finetuning_example(tmp_path, capfd):
    # --quick's fine-tuning demo is examples/bert_finetune.py itself, with both tricks.
    result = batchfit.finetune_demo(shared=str(tmp_path / "absent"))
    out = capfd.readouterr()
    assert "[benchmarks.batchfit] fine-tuning demo: python examples/bert_finetune.py --data " in out.err
    assert "--recompute --accum-steps 4" in out.err
    assert "held-out accuracy" in out.out  # the example's own report
    assert result["recompute"] is True and result["accum_steps"] == 4
    assert result["weight_updates"] == 8 and result["train_micro_steps"] == 32


def test_report_and_plot_have_a_line_per_policy(tmp_path):
    """Without measuring: a plan's table (one row per policy, the chosen line under it) and
    its cost, and one line per policy in the PNG."""
    import io

    opts = dict(seq_len=256, effective_batch=64, budget_gib=1.5)
    results = [dict(model="base", plan=_plan(), wall_s=100.0, cpu_s=150.0)]
    out = io.StringIO()
    batchfit.print_report(results, opts, out=out)
    table = out.getvalue()
    for row in ("| None | 717 | 102.4 | 12 | 12 | 1.400 | 16 refused | 0.4000 |",
                "| 'attention' |", "| 'block' | 717 | 25.6 | 64 | not checked |"):
        assert row in table, table
    assert "~0.7500 |" in table  # the estimate of the policy not checked
    assert "Chosen: policy 'attention', micro-batch 32 x 2 steps per update" in table
    assert "base: planned in 100 s wall, 150 CPU s" in table
    png = tmp_path / "fit.png"
    batchfit.plot(results, opts, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_policies_argument():
    assert batchfit.parse_args([]).policies == ("attention", "block")
    assert batchfit.parse_args(["--policies", "layer"]).policies == ("layer",)
    assert batchfit.policy_of("0") is None and batchfit.policy_of("1") == "block"


@pytest.mark.slow
def test_cpu_split_measures_user_and_system_time(tmp_path):
    """benchmarks.cpu_split (the CPU-time split behind docs/batchfit.md): a tiny BERT,
    RECOMPUTE=0 and a policy, fresh processes, with and without huge pages."""
    import json

    out = tmp_path / "split.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_split", "--shape", "tiny", "--layers", "1",
         "--seq-len", "16", "--modes", "0,block_keep_ffn", "--batch-sizes", "2", "--steps", "1",
         "--malloc", "hugepages", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU allocation: hugepages (--malloc)" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["batch"], r["layers"]) for r in rows] == [("0", 2, 1), ("block_keep_ffn", 2, 1)]
    for r in rows:
        assert r["user_per_sample"] > 0 and r["sys_per_sample"] >= 0 and r["peak_rss_mib"] > 100
        assert r["malloc"] == "hugepages"
    bad = subprocess.run([sys.executable, "-m", "benchmarks.cpu_split", "--modes", "0,full"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--modes: expected" in bad.stderr


@pytest.mark.slow
def test_cpu_split_paired_times_configurations_in_turn_in_one_process(tmp_path):
    """`--paired`: one process, a model per configuration (traced with its own
    recomputation setting), a step of each per round, each round's ratio to the first."""
    import json

    out = tmp_path / "paired.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_split", "--shape", "tiny", "--layers", "1",
         "--seq-len", "16", "--paired", "0:2,block:3", "--steps", "2", "--malloc", "tf-bfc",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU allocation: tf-bfc (--malloc)" in proc.stdout
    assert "round 2 of 2" in proc.stderr
    first, block = json.loads(out.read_text())["results"]
    assert (first["mode"], first["batch"], block["mode"], block["batch"]) == ("0", 2, "block", 3)
    assert first["round_ratios"] == [1.0, 1.0]
    assert len(block["round_ratios"]) == 2 and block["median_ratio"] in block["round_ratios"]
    assert all(r > 0 for r in block["round_ratios"]) and block["user_per_sample"] > 0
    for args, message in [(["--paired", "0:6", "--modes", "0"], "leave out --modes"),
                          (["--paired", "0:6,full:43"], "--paired: expected"),
                          (["--paired", "0:6,0:6"], "--paired: expected")]:
        bad = subprocess.run([sys.executable, "-m", "benchmarks.cpu_split", *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
