"""benchmarks.batchfit without measuring: the search logic, the report and plot, the
command line, and --quick's fine-tuning demo (own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1)."""

import os
import subprocess
import sys

import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

from benchmarks import batchfit  # noqa: E402  (does not import bert4keras)
from tests.helpers.commands import run_module  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTS = dict(seq_len=256, steps=1, accum_steps=1, max_batch=64, abort_factor=1.5)


def test_search_logic_without_processes():
    # Peak RSS = 1000 + 10 x batch MiB with a +-15 MiB wobble; budget 1500 MiB.
    def fake(model, shape, mode, batch, opts, paths):
        peak = 1000 + 10 * batch + (15 if batch % 3 == 0 else -15 if batch % 3 == 1 else 0)
        return dict(batch=batch, ok=True, fits=peak <= 1500, peak_rss_mib=float(peak),
                    cpu_s_per_sample=0.1)

    opts = dict(OPTS, budget_gib=1500 / 1024.0, max_batch=512)
    result = batchfit.search("base", batchfit.SHAPES["base"], "0", opts, measure_fn=fake)
    runs = {r["batch"]: r for r in result["runs"]}
    best = result["max_batch"]
    assert runs[best]["fits"] and not runs[best + 1]["fits"]
    assert 47 <= best <= 51 and len(runs) <= 8
    capped = batchfit.search("base", batchfit.SHAPES["base"], "0", dict(opts, max_batch=20),
                             measure_fn=fake)
    assert capped["max_batch"] == 20 and capped["capped"]


@pytest.mark.parametrize("argv, message", [
    (["--models", "base,huge"], "--models: expected a comma-separated list of distinct names "
                                "from base,large,minilm,tiny, got 'base,huge'"),
    (["--seq-len", "0"], "--seq-len: expected a positive integer, got '0'"),
    (["--budget-gib", "-2"], "--budget-gib: expected a positive number, got '-2'"),
    (["--budget-gib", "lots"], "--budget-gib: expected a positive number, got 'lots'"),
    (["--accum-steps", "1.5"], "--accum-steps: expected a positive integer, got '1.5'"),
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


@pytest.mark.slow
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
    """Without processes: RECOMPUTE=0 and two policies, each searched, summarized,
    printed as a table row with its ratios, and drawn as a line of the PNG."""
    import io

    slopes = {"0": 40.0, "attention": 20.0, "block": 5.0}

    def fake(model, shape, mode, batch, opts, paths):
        peak = 1000 + slopes[mode] * batch
        return dict(batch=batch, mode=mode, ok=True, fits=peak <= 1500, peak_rss_mib=float(peak),
                    cpu_s_per_sample=0.1 * (1.0 + 0.05 * list(slopes).index(mode)))

    opts = dict(OPTS, models=("base",), modes=("0", "attention", "block"),
                budget_gib=1500 / 1024.0, max_batch=512)
    shape = batchfit.SHAPES["base"]
    results = {("base", "0"): batchfit.search("base", shape, "0", opts, measure_fn=fake)}
    for policy in ("attention", "block"):
        results[("base", policy)] = batchfit.search(
            "base", shape, policy, opts, first=results[("base", "0")]["max_batch"], measure_fn=fake)
    rows = batchfit.summarize(results, opts)
    assert [r["mode"] for r in rows] == ["0", "attention", "block"]
    assert [r["max_batch"] for r in rows] == [12, 25, 100]
    assert rows[1]["batch_ratio"] == 25 / 12 and rows[2]["batch_ratio"] == 100 / 12
    out = io.StringIO()
    batchfit.print_report(rows, opts, out=out)
    table = out.getvalue()
    for policy, ratio in (("off", "-"), ("attention", "2.08"), ("block", "8.33")):
        assert any(line.split()[3:4] == [policy] and ratio in line for line in table.splitlines()), table
    assert "base policy=block: CPU time per sample over RECOMPUTE=0's at the same batch 12: x1.100" in table
    png = tmp_path / "fit.png"
    batchfit.plot(rows, opts, str(png))
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
