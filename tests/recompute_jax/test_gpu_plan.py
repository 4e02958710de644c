"""XLA:GPU's plan of the JAX training step, compiled for an H100 on this machine (no GPU):
the attention core the library chooses (`recompute.attention_core("auto")`) never plans more
than Keras's own core under any policy, and grows no faster per added block (but for
`BARRIER_SLACK`).

`benchmarks.gpu_plan`'s rows at small widths (hidden 128, seq 256, batch 4) but two depths (2
and 8 blocks): at BERT-base the blocked core planned 3x Keras's under "full" (231.0 against
78.0 MiB per sample) while at 2 blocks the two were close -- the excess grows with depth, so
one depth would miss it. Needs the `[test]` extra's jax-cuda12-pjrt and jax-cuda12-plugin."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.commands import plan_env

ROOT = Path(__file__).resolve().parents[2]
# Per added block, the chosen core may grow by XLA's small tuple buffers more than Keras's
# core: the blocked core's chained optimization barriers get 256 bytes each (seq 256,
# "attention": 1,792 bytes more from 2 to 8 blocks, while 1,792 bytes below Keras's at 2
# blocks and equal at 8; docs/attention.md, "The last bytes at seq 256").
BARRIER_SLACK = 1024
# Under "full", since the feed-forward pair (`recompute.ops._feed_forward_jax`, which runs
# under either core), Keras's core grows 42,837 bytes per added block less than the chosen
# core at these widths (2,903,552 against 3,166,720 bytes from 2 to 8 blocks, 2026-11-29;
# without the pair 3,162,624 against 3,159,552), while the chosen core stays below it at
# both depths (15,377,312 against 17,468,320 bytes at 8 blocks). Anything of a tensor's
# size kept per block -- the smallest here, one layer's dropout bits, 64 KiB at batch 4 --
# is above it and fails.
FULL_SLACK = 48 * 1024


# The rows of `python -m benchmarks.gpu_plan --model standard --layers 2,8 --hidden 128
# --heads 2 --ffn 256 --seq 256 --vocab 1000 --policies attention,full --cores auto,keras
# --offload` at batch 4 alone (the tool fits a slope over two batches or more: twice the
# compilations), printed as "row layers policy core temp host_temp" lines; then the command
# itself at a tiny width (`main`, two batches, "full" and its offloaded row), in the same
# process: one process and 9 + 4 compilations for the whole file.
_ROWS = """
import sys
from benchmarks import gpu_plan
gpu_plan.prepare_environment()
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # the tool's fp32
cfg = dict(gpu_plan.DEFAULTS, model="standard", hidden=128, heads=2, ffn=256, seq=256,
           vocab=1000)
sharding = gpu_plan.target_sharding("h100")
rows = [(layers, policy, core) for layers in (2, 8) for policy in ("attention", "full")
        for core in ("auto", "keras")] + [(8, gpu_plan.OFFLOAD, "auto")]
for layers, policy, core in rows:
    row = dict(cfg, layers=layers)
    model = gpu_plan.build_model(row, policy, core)
    plan = gpu_plan.step_plan(model, row, policy, 4, sharding)
    print("row", layers, policy, core, plan["temp"], plan["host_temp"], flush=True)
sys.exit(gpu_plan.main(["--model", "standard", "--layers", "1", "--hidden", "32", "--heads",
                        "2", "--ffn", "64", "--seq", "16", "--vocab", "100", "--batches", "1,2",
                        "--policies", "full", "--cores", "auto", "--offload",
                        "--json", sys.argv[1]]))
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`(rows, table, record)`: {(layers, policy, core): (temp, host_temp)} of `_ROWS`'s rows,
    and the tiny command's printed table and JSON record."""
    out = tmp_path_factory.mktemp("gpu_plan") / "plan.json"
    env = plan_env(KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", _ROWS, str(out)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {(int(layers), policy, core): (int(temp), int(host)) for _, layers, policy, core, temp,
            host in (line.split() for line in done.stdout.splitlines() if line.startswith("row "))}
    assert len(rows) == 9, done.stdout
    table = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("row "))
    return rows, table, json.loads(out.read_text())


@pytest.mark.slow(seconds=300)  # the fixture: 13 compilations for a GPU
def test_chosen_core_plans_no_more_than_keras_core(planned):
    temp = {key: value[0] for key, value in planned[0].items()}
    for policy in ("attention", "full"):
        for layers in (2, 8):
            assert temp[layers, policy, "auto"] <= temp[layers, policy, "keras"], (policy, layers,
                                                                                   temp)
        growth = {core: temp[8, policy, core] - temp[2, policy, core] for core in ("auto", "keras")}
        slack = FULL_SLACK if policy == "full" else BARRIER_SLACK
        assert growth["auto"] <= growth["keras"] + 6 * slack, (policy, growth, temp)
    # "attention" keeps per block what its backward pass multiplies by and no more
    # (policies/_jax._block_checkpointed): the block's input, q, k, v, the core's output,
    # the first LayerNorm's output and the feed-forward's two products, 7 [seq, hidden]
    # floats and one [seq, ffn] (4.5 MiB at batch 4; 6.0 before, when the residual sums,
    # the LayerNorms' intermediates and the dropouts' masks were kept too). One [seq,
    # hidden] more per block fails.
    unit = 4 * 256 * 4  # bytes of one feature at batch 4, seq 256, float32
    per_block = (temp[8, "attention", "auto"] - temp[2, "attention", "auto"]) / 6
    assert per_block < (7 * 128 + 256 + 128) * unit, (per_block, temp)
    # the plan sees what recomputation saves: "full" below "attention" at 8 blocks
    assert temp[8, "full", "auto"] < temp[8, "attention", "auto"], temp


def test_refuses_a_process_whose_jax_started_without_cuda():
    # started: its backends initialized (importing jax alone is not starting it, and the
    # platform can still be named then)
    code = ("import os; os.environ['JAX_PLATFORMS'] = 'cpu'; import jax; jax.devices(); "
            "from benchmarks import gpu_plan; gpu_plan.prepare_environment()")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "needs JAX started with JAX_PLATFORMS=cpu,cuda" in result.stderr
    assert "run it in a fresh process" in result.stderr


def test_counts_loops_and_softmax_passes_of_a_compiled_module():
    from benchmarks.gpu_plan import count_module

    hlo = """
  %fused_exp = f32[4,12,128,512]{3,2,1,0} exponential(%sub.1)
  %e2 = f32[4,12,512,512]{3,2,1,0} exponential(%x)
  %other = f32[4,512,3072]{2,1,0} exponential(%y)
  %while.11 = (s32[], f32[64,64]{1,0}, f32[3,64,64]{2,1,0}) while(%tuple.2), condition=%c, body=%b
  %while.17 = (s32[], f32[64,64]{1,0}) while(%tuple.7), condition=%c2, body=%b2
"""
    assert count_module(hlo, 512) == (2, 2)
    assert count_module(hlo, 3072) == (2, 1)


@pytest.mark.slow(seconds=10)  # the fixture's, counted above
def test_offload_plans_the_inputs_on_the_host(planned):
    """`--offload` at small widths, 8 blocks, batch 4: the offloaded row keeps every block's
    input in host memory (7 temporaries of [seq, hidden] float32 per sample; the first block's
    input is the embeddings' output, a temporary too) and plans no more device memory than
    "full"; the command prints and records that row with its host columns."""
    rows, table, record = planned
    (full, full_host), (offload, offload_host) = rows[8, "full", "auto"], rows[8, "full+offload",
                                                                               "auto"]
    assert full_host == 0
    assert offload_host >= 7 * 256 * 128 * 4 * 4, rows
    assert offload <= full, rows
    assert "host temp MiB" in table and '"full", offload' in table, table
    by = {r["policy"]: r for r in record["rows"]}
    assert set(by) == {"full", "full+offload"} and by["full"]["host_temp"] == 0
    assert by["full+offload"]["host_temp"] > 0 and record["config"]["batches"] == [1, 2]
