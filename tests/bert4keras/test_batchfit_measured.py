"""benchmarks.batchfit measured: the batch search and RECOMPUTE's saving on a tiny shape,
in fresh worker processes (own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1)."""

import os
import threading

import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

from benchmarks import batchfit  # noqa: E402  (does not import bert4keras)

pytestmark = pytest.mark.slow  # measured peak memory, end to end: the newest Python in CI

SHAPE = batchfit.SHAPES["tiny"]  # 2 layers, hidden 64, 8 heads, FFN 256, vocab 1000
# seq 256: each sample's [8, 256, 256] attention tensors make tens of MiB per
# sample, well above the allocator's noise (a few MiB) on this tiny model.
OPTS = dict(seq_len=256, steps=1, accum_steps=1, max_batch=64, abort_factor=1.5)


def measure(mode, batch, budget_gib=4.0, shape=SHAPE):
    return batchfit.measure("tiny", shape, mode, batch, dict(OPTS, budget_gib=budget_gib))


def test_search_returns_a_batch_verified_by_measurement():
    probe = measure("0", 1)
    assert probe["ok"] and probe["fits"] and probe["cpu_s_per_sample"] > 0
    # A budget that leaves room for a handful of samples above batch 1.
    budget_mib = probe["peak_rss_mib"] + 130.0
    opts = dict(OPTS, budget_gib=budget_mib / 1024.0)
    calls = []

    def counting_measure(*args):
        calls.append(args[3])
        return batchfit.measure(*args)

    result = batchfit.search("tiny", SHAPE, "0", opts, known=[probe], measure_fn=counting_measure)
    best = result["max_batch"]
    runs = {r["batch"]: r for r in result["runs"]}
    assert 2 <= best < 40 and not result["capped"]
    # Verified: the answer was measured within the budget, the next batch over it.
    assert runs[best]["fits"] and runs[best]["peak_rss_mib"] <= budget_mib
    assert not runs[best + 1]["fits"] and runs[best + 1]["peak_rss_mib"] > budget_mib
    assert result["peak_rss_mib"] == runs[best]["peak_rss_mib"]
    assert result["cpu_s_per_sample"] > 0
    assert len(calls) <= 6, calls  # a few fresh processes, not a scan
    assert len(set(calls)) == len(calls)  # no batch measured twice


def test_recompute_lowers_peak_rss_at_a_fixed_batch():
    # Six layers: bert4keras recomputes layer by layer, so what is saved (all
    # but ~7 [seq, hidden] tensors per layer) grows with depth, while one
    # attention layer's working set stays (~12 MiB per sample here).
    shape = dict(SHAPE, layers=6)
    results = {}

    def run(mode):
        results[mode] = measure(mode, 16, shape=shape)

    threads = [threading.Thread(target=run, args=(mode,)) for mode in ("0", "1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    off, on = results["0"], results["1"]
    assert off["recompute_enabled"] is False and on["recompute_enabled"] is True
    assert off["fits"] and on["fits"]
    # Expected ~35 MiB per sample less with recomputation: ~550 MiB at batch 16.
    assert on["peak_rss_mib"] < off["peak_rss_mib"] - 250, (on["peak_rss_mib"], off["peak_rss_mib"])
