"""benchmarks.attention_seq: its arguments, its table, and a tiny end-to-end run."""

import json
import subprocess
import sys

import pytest

from benchmarks import attention_seq


def test_bad_arguments_are_refused(capsys):
    for argv, message in (
        (["--batch-sizes", "2"], "`--batch-sizes` must list at least 2 batch sizes (the slope). "
                                 "Received: --batch-sizes=2"),
        (["--modes", "full,bad"], "expected a comma-separated list of distinct names from "
                                  "0,full,attention, got 'full,bad'"),
        (["--seqs", "0"], "expected comma-separated positive integers"),
    ):
        with pytest.raises(SystemExit):
            attention_seq.parse_args(argv)
        assert message in capsys.readouterr().err


def test_table_shows_growth_and_failures():
    results = {512: {"0": 100.0, "full": 10.0}, 1024: {"0": 400.0, "full": 20.0},
               2048: {"full": None}}
    text = attention_seq.table([512, 1024, 2048], results, ["0", "full"])
    lines = text.splitlines()
    assert "RECOMPUTE=0" in lines[0] and "full" in lines[0]
    assert "400.0" in lines[2] and "x4.0" in lines[2] and "x2.0" in lines[2]
    assert "-" in lines[3] and "failed" in lines[3]  # 0 not run at 2048; full failed


@pytest.mark.slow(seconds=75)
def test_tiny_run(tmp_path):
    """Two sequence lengths, one mode: each configuration is a fresh process (the modes'
    columns are test_table_shows_growth_and_failures's)."""
    out = tmp_path / "seq.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.attention_seq", "--seqs", "32,64", "--layers", "1",
         "--hidden", "128", "--heads", "2", "--ffn", "256", "--steps", "1", "--modes", "full",
         "--plot", str(tmp_path / "seq.png"), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"32", "64"} and set(results["32"]) == {"full"}
    assert all(results[seq]["full"] is not None for seq in results)  # no worker failed
    assert (tmp_path / "seq.png").stat().st_size > 1000
    assert ["seq", "full"] in [line.split() for line in done.stdout.splitlines()]  # the table
