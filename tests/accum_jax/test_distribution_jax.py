"""`keras.distribution` on Keras 3's JAX backend, 4 virtual CPU devices: `AccumOptimizer`
("buffer", "rescale") and `recompute_grad` / `recompute.keras_hub.patch()` under
`DataParallel` and `ModelParallel` (a `LayoutMap` sharding a Dense kernel) train to the
weights of one device at the same global batch, through `fit` and through jitted
`stateless_call` steps. Keras's compiled train step all-reduces every gradient on every
micro-step; under `accum.local_gradients` it does so once per update, inside the update's
`cond`, and trains to the same weights (issue 28).

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
# Each group of scenarios is one worker process that runs all of them: the newest
# Python's full run only.
pytestmark = pytest.mark.slow(seconds=20)  # each; the worker processes: 480 s in all
# Float32 rounding: the devices sum their shards' partial sums (the loss's mean, each
# gradient's batch sum) in another order than one device. Measured: <= 5.5e-7 (jax 0.10,
# XLA:CPU, 2026-11); with BatchNormalization's batch moments reduced across devices,
# 1.9e-6 after 3 Adam steps (`test_batch_norm...`).
TOL = 1e-6
TOL_BATCH_NORM = 1e-5

ACCUM = [f"accum_{mode}_{kind}_{how}" for kind in ("dp", "mp") for mode in ("buffer", "rescale")
         for how in ("fit", "stateless")]
RECOMPUTE = [f"recompute_{kind}_{how}" for kind in ("dp", "mp") for how in ("fit", "stateless")]
LOCAL = ["local_dp_fit", "local_mp_fit", "local_dp_resume", "local_dp_mixed"]
SLOW = ["recompute_batch_norm_dp", "recompute_batch_norm_mp", "keras_hub_dp", "keras_hub_mp"]
# `local_dp_mixed`: three micro-steps' reduced gradients go to the buffers' row 0, the
# others' to their devices' rows: another summation order. Measured 1.1e-6 (a 2-element
# bias's Adam momentum), the rest <= 4.2e-7.
TOL_MIXED = 2e-6


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
    return run_worker(tmp_path_factory.mktemp("jax_distribution"),
                      ACCUM + RECOMPUTE + LOCAL + ["local_dp_dropout", "allreduce_counts"])


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


@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_batch_norm_recompute_matches_one_device(slow_runs, kind):
    """With BatchNormalization in the block: RECOMPUTE=1 equals RECOMPUTE=0 under the same
    distribution (to 1e-6; measured equal), and both equal one device to 1e-5 -- the batch
    moments summed across devices in another order, amplified through normalization."""
    names, runs, sharded = load(slow_runs, f"recompute_batch_norm_{kind}")
    check_layout(f"_{kind}", sharded)
    assert_all_close(runs["same"], runs["got"], names, rtol=TOL)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL_BATCH_NORM)


@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_keras_hub_patch_matches_one_device(slow_runs, kind):
    """A tiny keras-hub BertBackbone classifier, `patch()` and RECOMPUTE=1 under the
    distribution (MP: the FFN's intermediate kernel sharded), against one device unpatched."""
    names, runs, sharded = load(slow_runs, f"keras_hub_{kind}")
    check_layout(f"_{kind}", sharded)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL)


PARAMETERS = worker.FEATURES * worker.HIDDEN + worker.HIDDEN + worker.HIDDEN * worker.OUTPUTS + worker.OUTPUTS


def allreduce_counts(fast_runs):
    data = np.load(os.path.join(fast_runs, "allreduce_counts.npz"))
    return dict(zip((str(label) for label in data["labels"]), data["counts"].tolist()))


def test_keras_step_allreduces_every_micro_step(fast_runs):
    """DataParallel's compiled train step (Keras's) holds one (tuple) all-reduce of the loss
    and every gradient, outside the update's `cond`: it runs on every micro-step, for plain
    Adam and for AccumOptimizer at k = 1, 4, 8 alike."""
    counts = allreduce_counts(fast_runs)
    for label in ("adam", "accum_k1", "accum_k4", "accum_k8"):
        every_step, on_updates_only, floats, _ = counts[label]
        assert (every_step, on_updates_only) == (1, 0), (label, counts[label])
        assert floats == PARAMETERS + 1, (label, counts[label])  # the gradients and the loss


@pytest.mark.parametrize("kind", ["dp", "mp"])
@pytest.mark.parametrize("k", [4, 8])
def test_local_gradients_allreduce_once_per_update(fast_runs, kind, k):
    """Under `accum.local_gradients` the gradients are all-reduced in one all-reduce inside
    the update's `cond` (every parameter once under DataParallel; under ModelParallel the
    replicated parameters and each device's share of the sharded ones); every micro-step
    reduces only scalars -- the loss for the logs, the finite flags -- and, under
    ModelParallel, the forward pass's activations over the "model" axis (8 floats here)."""
    every_step, on_updates_only, floats, on_updates = allreduce_counts(fast_runs)[f"local_{kind}_k{k}"]
    assert on_updates_only == 1
    if kind == "dp":
        assert on_updates == PARAMETERS
        assert floats <= 3, floats  # the loss and the metrics' scalars
    else:
        # Each device reduces its share of the gradients over "batch": at least the half
        # of d1's that it holds; XLA may split more (measured: d2's kernel too, 74 of 146).
        shares = PARAMETERS - (worker.FEATURES * worker.HIDDEN + worker.HIDDEN) // 2
        assert PARAMETERS // 2 <= on_updates <= shares, on_updates
        assert floats <= 3 + worker.B // 2 * worker.OUTPUTS, floats
    assert every_step <= 4, every_step


def test_local_gradients_k1_reduces_every_step(fast_runs):
    """k = 1 updates on every micro-step: one all-reduce of every gradient per step."""
    every_step, on_updates_only, floats, _ = allreduce_counts(fast_runs)["local_dp_k1"]
    assert on_updates_only == 0 and floats >= PARAMETERS


@pytest.mark.parametrize("scenario", LOCAL)
def test_local_gradients_match_one_device(fast_runs, scenario):
    """`accum.local_gradients`, k = 3, against one device's `fit` at the same global batch:
    weights, counters, inner slots and buffers (their devices' rows summed) -- after 7
    micro-steps under DataParallel and ModelParallel; saved mid-window as `.keras` on 4
    devices, loaded on one and trained 2 more micro-steps (against 9 on one device); and
    4 micro-steps of `fit` followed by 3 of a custom jitted step that hands the optimizer
    reduced gradients. The buffers have one row per device, laid out over "batch" (and
    over "model" as their weight, under ModelParallel)."""
    names, runs, specs = load(fast_runs, scenario)
    assert_all_close(runs["ref"], runs["got"], names, rtol=TOL_MIXED if "mixed" in scenario else TOL)
    if scenario != "local_dp_resume":
        assert specs and all(spec.startswith("('batch'") for spec in specs), specs
    if scenario == "local_mp_fit":
        assert "('batch', None, 'model')" in specs, specs


def test_local_gradients_dropout(fast_runs):
    """The recomputed dropout blocks under `local_gradients`: RECOMPUTE=1 equals RECOMPUTE=0
    (the devices' draws replayed); the devices draw their own masks (a micro-step whose four
    shards hold the same samples leaves four different rows in the buffer); the seed
    states advance as one device's do."""
    names, runs, _ = load(fast_runs, "local_dp_dropout")
    assert_all_close(runs["same"], runs["got"], names, rtol=TOL)
    data = np.load(os.path.join(fast_runs, "local_dp_dropout.npz"))
    rows = data["rows_0"]
    assert rows.shape[0] == worker.DEVICES
    for i in range(1, worker.DEVICES):
        assert np.abs(rows[i] - rows[0]).max() > 1e-3, i
    seeds = [data[f"seeds_{i}"] for i in range(2)]
    one_device = [data[f"ref_{i}"] for i in range(2)]
    for got, want in zip(seeds, one_device):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------ two processes (jax.distributed)

@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Runs tests.helpers.jax_multiprocess_worker as 2 processes on localhost (2 CPU
    devices each), joined by `keras.distribution.initialize`."""
    import socket

    out_dir = tmp_path_factory.mktemp("jax_processes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(KERAS_BACKEND="jax", CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.jax_multiprocess_worker", str(out_dir), str(i), port],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-6000:]
    return out_dir


@pytest.mark.parametrize("way", ["keras", "local"])
def test_two_processes_match_one_device(two_processes, way):
    """2 processes x 2 CPU devices (`jax.distributed`), each feeding its half of every
    global batch: `AccumOptimizer(Adam, 3)` with Keras's step and with
    `accum.local_gradients`, 7 micro-steps: both processes hold one device's weights,
    counters, slots and buffers (rows summed)."""
    reference, names = worker.accum_result(worker.accum_fit("buffer"))
    for process in range(2):
        data = np.load(os.path.join(two_processes, f"process{process}.npz"))
        got = [data[f"{way}_{i}"] for i in range(len(reference))]
        assert_all_close(reference, got, names, rtol=TOL)


def test_two_processes_save_loads_on_one_device(two_processes):
    """Each process saved the `local_gradients` model mid-window (the buffers' rows lie on
    both processes): loaded here on one device, weights and optimizer state are one
    device's."""
    import keras

    reference, names = worker.accum_result(worker.accum_fit("buffer"))
    for process in range(2):
        model = keras.models.load_model(os.path.join(two_processes, f"process{process}.keras"))
        got, _ = worker.accum_result((model, model.optimizer))
        assert_all_close(reference, got, names, rtol=TOL)
