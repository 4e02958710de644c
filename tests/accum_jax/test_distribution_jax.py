"""`keras.distribution` on Keras 3's JAX backend, 4 virtual CPU devices: `AccumOptimizer`
("buffer", "rescale") and `recompute_grad` / `recompute.keras_hub.patch()` under
`DataParallel` and `ModelParallel` (a `LayoutMap` sharding a Dense kernel) train to the
weights of one device at the same global batch, through `fit` and through jitted
`stateless_call` steps; the compiled train step all-reduces every gradient on every
micro-step today (issue 28).

The runs need `XLA_FLAGS=--xla_force_host_platform_device_count=4` before JAX initializes,
so they live in a worker process (`tests.helpers.jax_distribution_worker`), started once
per group of scenarios; these tests compare what it wrote. Float32, pinned
(`recompute.exact_float32()` in the worker).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import jax_distribution_worker as worker
from tests.helpers.numerics import assert_all_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Float32 rounding: the devices sum their shards' partial sums (the loss's mean, each
# gradient's batch sum) in another order than one device. Measured: <= 5.5e-7 (jax 0.10,
# XLA:CPU, 2026-11); with BatchNormalization's batch moments reduced across devices,
# 1.9e-6 after 3 Adam steps (`test_batch_norm...`).
TOL = 1e-6
TOL_BATCH_NORM = 1e-5

ACCUM = [f"accum_{mode}_{kind}_{how}" for kind in ("dp", "mp") for mode in ("buffer", "rescale")
         for how in ("fit", "stateless")]
RECOMPUTE = [f"recompute_{kind}_{how}" for kind in ("dp", "mp") for how in ("fit", "stateless")]
SLOW = ["recompute_batch_norm_dp", "recompute_batch_norm_mp", "keras_hub_dp", "keras_hub_mp"]


def run_worker(out_dir, scenarios, timeout=600):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.jax_distribution_worker", str(out_dir), *scenarios],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND="jax", CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return out_dir


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("jax_distribution"), ACCUM + RECOMPUTE + ["allreduce_counts"])


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("jax_distribution_slow"), SLOW)


def load(out_dir, scenario):
    """(names, {run: arrays}, sharded variable paths) of one scenario."""
    data = np.load(os.path.join(out_dir, f"{scenario}.npz"))
    names = [str(n) for n in data["names"]]
    runs = {}
    for key in data.files:
        run, _, index = key.rpartition("_")
        if index.isdigit():
            runs.setdefault(run, [None] * len(names))[int(index)] = data[key]
    return names, runs, [str(n) for n in data["sharded"]]


def check_layout(scenario, sharded):
    """ModelParallel did shard the first Dense layer's kernel over "model"; DataParallel nothing."""
    if "_mp" in scenario:
        assert any(name.endswith(("d1/kernel", "up/kernel", "intermediate_dense/kernel")) for name in sharded), sharded
    else:
        assert not sharded, sharded


@pytest.mark.parametrize("scenario", ACCUM)
def test_accum_optimizer_matches_one_device(fast_runs, scenario):
    """k = 3, 7 micro-steps of global batch 8 (two updates, one pending): weights, buffers,
    counters and inner slots equal one device's."""
    names, runs, sharded = load(fast_runs, scenario)
    check_layout(scenario, sharded)
    if "_mp" in scenario and "buffer" in scenario:  # the buffer follows its weight's layout
        assert any(name.endswith("d1_kernel_accumulator") for name in sharded), sharded
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL)


@pytest.mark.parametrize("scenario", RECOMPUTE)
def test_recompute_matches_one_device(fast_runs, scenario):
    """RECOMPUTE=1 under the distribution against RECOMPUTE=0 on one device: weights after
    3 `fit` steps, or the loss, gradients and seed states of a jitted `stateless_call`."""
    names, runs, sharded = load(fast_runs, scenario)
    check_layout(scenario, sharded)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_batch_norm_recompute_matches_one_device(slow_runs, kind):
    """With BatchNormalization in the block: RECOMPUTE=1 equals RECOMPUTE=0 under the same
    distribution (to 1e-6; measured equal), and both equal one device to 1e-5 -- the batch
    moments summed across devices in another order, amplified through normalization."""
    names, runs, sharded = load(slow_runs, f"recompute_batch_norm_{kind}")
    check_layout(f"_{kind}", sharded)
    assert_all_close(runs["same"], runs["got"], names, rtol=TOL)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL_BATCH_NORM)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_keras_hub_patch_matches_one_device(slow_runs, kind):
    """A tiny keras-hub BertBackbone classifier, `patch()` and RECOMPUTE=1 under the
    distribution (MP: the FFN's intermediate kernel sharded), against one device unpatched."""
    names, runs, sharded = load(slow_runs, f"keras_hub_{kind}")
    check_layout(f"_{kind}", sharded)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL)


def test_allreduce_every_micro_step_today(fast_runs):
    """DataParallel's compiled train step holds one (tuple) all-reduce of the loss and every
    gradient, outside the update's `cond`: it runs on every micro-step, for plain Adam and
    for AccumOptimizer at k = 1, 4, 8 alike (issue 28, item 2 is to move it to the window's
    end)."""
    data = np.load(os.path.join(fast_runs, "allreduce_counts.npz"))
    counts = dict(zip((str(label) for label in data["labels"]), data["counts"].tolist()))
    parameters = worker.FEATURES * worker.HIDDEN + worker.HIDDEN + worker.HIDDEN * worker.OUTPUTS + worker.OUTPUTS
    for label in ("adam", "accum_k1", "accum_k4", "accum_k8"):
        every_step, on_updates_only, elements = counts[label]
        assert (every_step, on_updates_only) == (1, 0), (label, counts[label])
        assert elements == parameters + 1, (label, counts[label])  # the gradients and the loss
