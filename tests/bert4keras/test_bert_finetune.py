"""examples/bert_finetune.py: data errors, and short real fine-tunes of MiniLM on
the sentence-polarity data (own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "bert_finetune.py"
RT_POLARITY = ROOT.parent / "shared" / "data" / "rt-polarity"


def _load_example():
    spec = importlib.util.spec_from_file_location("bert_finetune_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ft = _load_example()


def write(path, data):
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def error_of(path):
    with pytest.raises(ft.DataError) as info:
        ft.load_data(path)
    return str(info.value)


def test_polarity_directory_and_tsv_are_read(tmp_path):
    write(tmp_path / "a.pos", "good film\ngreat cast\n")
    write(tmp_path / "a.neg", "dull\r\n")
    texts, labels = ft.load_data(tmp_path)
    assert sorted(zip(texts, labels)) == [("dull", 0), ("good film", 1), ("great cast", 1)]
    tsv = write(tmp_path / "d.tsv", "0\tbad\n2\tso-so\tok\n1\tfine")
    assert ft.load_data(tsv) == (["bad", "so-so\tok", "fine"], [0, 2, 1])


@pytest.mark.parametrize(
    "files, expected",
    [
        ({}, "has no *.pos or *.neg file"),
        ({"a.pos": "good\n"}, "only *.pos files"),
        ({"a.pos": "good\n\nfine\n", "a.neg": "bad\n"}, "a.pos, line 2: empty line"),
        ({"a.pos": "good\n", "a.neg": b"bad\n\xff\xfe\n"}, "a.neg, line 2: not UTF-8"),
        ({"a.pos": "", "a.neg": "bad\n"}, "a.pos is empty"),
    ],
)
def test_polarity_directory_errors_name_file_and_line(tmp_path, files, expected):
    for name, data in files.items():
        write(tmp_path / name, data)
    assert expected in error_of(tmp_path)


@pytest.mark.parametrize(
    "data, expected",
    [
        ("0\tbad\n1 good\n", "line 2: no tab"),
        ("0\tbad\npositive\tgood\n", "line 2: the label must be an integer >= 0. Received: 'positive'"),
        ("0\tbad\n-1\tgood\n", "line 2: the label must be an integer >= 0"),
        ("0\tbad\n1\t  \n", "line 2: the text after the tab is empty"),
        ("0\tbad\n0\tworse\n", "a classifier needs at least 2 classes"),
        ("", "is empty"),
    ],
)
def test_tsv_errors_name_file_and_line(tmp_path, data, expected):
    message = error_of(write(tmp_path / "d.tsv", data))
    assert expected in message and "d.tsv" in message


def test_missing_data_says_what_was_expected(tmp_path):
    message = error_of(tmp_path / "nowhere")
    assert "does not exist" in message and "*.pos/*.neg" in message


def run_script(*args, timeout=600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RECOMPUTE", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--accum-steps", "0"], "`--accum-steps` must be an integer >= 1. Received: --accum-steps=0"),
        (["--batch-size", "2.5"], "`--batch-size` must be an integer >= 1. Received: --batch-size=2.5"),
        (["--lr", "-1"], "`--lr` must be a number > 0"),
        (["--valid-fraction", "1"], "`--valid-fraction` must be in (0, 1)"),
        (["--dropout", "1"], "`--dropout` must be in [0, 1)"),
    ],
)
def test_bad_arguments(tmp_path, args, expected):
    result = run_script("--data", str(tmp_path), *args, timeout=60)
    assert result.returncode == 2 and expected in result.stderr, result.stderr


def test_bad_data_fails_before_building_anything(tmp_path):
    write(tmp_path / "a.pos", "good\n")
    write(tmp_path / "a.neg", "bad\n\n")
    out = tmp_path / "results.json"
    result = run_script("--data", str(tmp_path), "--json", str(out), timeout=120)
    assert result.returncode == 2
    assert "a.neg, line 2: empty line" in result.stderr
    assert not out.exists()  # nothing written


needs_data = pytest.mark.skipif(
    not RT_POLARITY.is_dir(), reason=f"the sentence-polarity data is not at {RT_POLARITY}"
)


@needs_data
@pytest.mark.slow(seconds=180)
def test_recompute_and_accumulation_equal_the_plain_big_batch(tmp_path):
    """The real MiniLM fine-tuned on real data: micro-batch 4 x 2 with RECOMPUTE=1
    ends where batch 8 without either ends (same examples; dropout off, since two
    micro-batches cannot draw one big batch's masks -- recomputation with
    dropout on is compared with plain runs in test_bert4keras_patch.py)."""
    common = ["--data", str(RT_POLARITY), "--seq-len", "24", "--max-steps", "3", "--lr", "1e-4",
              "--valid-fraction", "0.02", "--dropout", "0"]
    results = {}
    for name, extra in {"plain": ["--batch-size", "8"],
                        "both": ["--batch-size", "4", "--accum-steps", "2", "--recompute"]}.items():
        out = tmp_path / f"{name}.json"
        result = run_script(*common, *extra, "--json", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "held-out accuracy" in result.stdout
        results[name] = json.loads(out.read_text())
    plain, both = results["plain"], results["both"]
    assert plain["weight_updates"] == both["weight_updates"] == 3
    assert both["train_micro_steps"] == 6 and both["recompute"] and both["effective_batch"] == 8
    assert abs(plain["held_out_loss"] - both["held_out_loss"]) <= 1e-5 * abs(plain["held_out_loss"])
    assert plain["held_out_accuracy"] == both["held_out_accuracy"]
    assert both["peak_rss_mib"] > 0 and both["samples_per_s"] > 0
