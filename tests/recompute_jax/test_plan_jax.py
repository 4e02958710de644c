"""`recompute.plan` on Keras's JAX backend: XLA's plan (`memory="plan"`, the default there) of
Keras's own jitted `train_step`, compiled for the local device and run for its time, or
compiled for a GPU this machine does not have (`target="h100"`: a plan, nothing run).

The model is tiny (2 Transformer-like blocks, seq 32, width 32) so that each suite's plan takes
seconds; the target's plan runs in a fresh process (JAX must start with the CUDA platform
named) and needs the `[test]` extra's jax-cuda12-pjrt and jax-cuda12-plugin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import recompute
from recompute import _xla_plan, planner, recompute_grad
from tests.helpers.commands import plan_env

ROOT = Path(__file__).resolve().parents[2]
SEQ, WIDTH, EFFECTIVE = 32, 32, 16
BUDGET_GIB = 2.0 / 1024  # XLA plans every byte: 2 MiB binds between micro-batches 4 and 16

MODEL = '''
import keras
import numpy as np
from recompute import recompute_grad

SEQ, WIDTH = %d, %d


def build_model(policy):
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = keras.layers.MultiHeadAttention(2, WIDTH // 2)
            self.d1 = keras.layers.Dense(WIDTH * 4, activation="gelu")
            self.d2 = keras.layers.Dense(WIDTH)
            self.ln1 = keras.layers.LayerNormalization()
            self.ln2 = keras.layers.LayerNormalization()

        def call(self, x, training=None):
            x = self.ln1(x + self.mha(x, x, training=training))
            return self.ln2(x + self.d2(self.d1(x)))

    if policy is not None:
        Block.call = recompute_grad(policy=policy)(Block.call)
    keras.utils.set_random_seed(0)
    inp = keras.Input((SEQ, WIDTH))
    h = inp
    for _ in range(2):
        h = Block()(h)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def data(n, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, SEQ, WIDTH).astype("float32"), rng.randn(n, 1).astype("float32")
''' % (SEQ, WIDTH)
namespace = {}
exec(compile(MODEL, "tiny_model", "exec"), namespace)
build_model, data = namespace["build_model"], namespace["data"]


def check_plan(p, effective, budget_bytes):
    """The micro-batch planned fits, the next divisor up is planned not to (or it is the
    effective batch), per candidate; the choice is among those that fit."""
    divs = planner.divisors(effective)
    refused = 0
    for c in p.candidates:
        assert c.slope > 0, p.table()
        if not c.fits:
            continue
        assert c.measured_peak <= budget_bytes
        if c.refused_batch is None:
            assert c.micro_batch == effective, p.table()
        else:
            refused += 1
            assert c.refused_batch == divs[divs.index(c.micro_batch) + 1]
            assert c.points[c.refused_batch][0] > budget_bytes
    assert refused >= 1, p.table()  # the budget binds somewhere
    assert p.micro_batch * p.steps_per_update == effective


@pytest.fixture(scope="module")
def local_plan():
    x, y = data(4)
    return recompute.plan(build_model, x, y, effective_batch=EFFECTIVE, budget_gib=BUDGET_GIB,
                          policies=(None, "full"), every_policy=True, verbose=False)


@pytest.mark.slow(seconds=80)  # 8 compilations and runs of the step
def test_plan_is_xla_plan_of_the_local_device_by_default_on_jax(local_plan):
    p = local_plan
    assert p.planned and p.target is None and "local cpu device" in p.memory
    check_plan(p, EFFECTIVE, BUDGET_GIB * planner.GiB)
    # compiled for the local device, each step also ran: a time per sample, the fastest chosen
    fastest = min((c for c in p.candidates if c.fits), key=lambda c: c.seconds_per_sample)
    assert p.policy == fastest.policy and p.seconds_per_sample > 0
    assert "planned peak GiB" in p.table()


@pytest.mark.fast
def test_planned_peak_is_the_compiled_steps_buffers():
    """arguments + outputs - aliases + temp of Keras's jitted train_step, the state donated:
    the outputs that alias the state are not counted twice."""
    model = build_model(None)
    x, y = data(4)
    _, plan = _xla_plan.train_step_plan(model, x, y)
    state_bytes = sum(int(np.prod(v.shape)) * 4 for v in
                      model.trainable_variables + model.optimizer.variables)
    assert plan["aliases"] >= state_bytes  # the new weights and slots reuse the donated ones
    assert plan["peak"] == plan["arguments"] + plan["outputs"] - plan["aliases"] + plan["temp"]
    assert plan["peak"] < plan["arguments"] + plan["outputs"] + plan["temp"]


@pytest.mark.slow  # the plan of the fixture
def test_training_with_the_plan_equals_one_big_batch(local_plan):
    """3 updates of the effective batch, dropout off: the plan's micro-batches and
    accumulation train the same weights as the effective batch at once (1e-5)."""
    x, y = data(3 * EFFECTIVE, seed=1)
    big = build_model(None)
    big.fit(x, y, batch_size=EFFECTIVE, shuffle=False, verbose=0)
    model = local_plan.build(build_model)
    assert local_plan.steps_per_update > 1, local_plan.table()
    local_plan.fit(model, x, y, shuffle=False, verbose=0)
    scale = max(np.abs(w).max() for w in big.get_weights())
    for a, b in zip(model.get_weights(), big.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def test_target_needs_jax_started_with_the_cuda_platform():
    """This process's JAX started without it: one clear error, before any model is built."""
    import jax

    jax.devices()  # started
    calls = []
    x, y = data(4)
    with pytest.raises(RuntimeError, match="needs JAX started with JAX_PLATFORMS=cpu,cuda"):
        recompute.plan(lambda p: calls.append(p) or build_model(p), x, y, EFFECTIVE, 1,
                       target="h100")
    assert calls == []


def test_target_must_be_a_known_card():
    x, y = data(4)
    with pytest.raises(ValueError, match=r"`target` must be one of a100-40, h100, l4, rtx4090"
                                         r".*Received: target='v100'"):
        recompute.plan(build_model, x, y, EFFECTIVE, 1, target="v100")


def docs_example():
    """The JAX example of docs/plan.md (its block after `<!-- plan-jax-example`)."""
    text = (ROOT / "docs" / "plan.md").read_text()
    rest = text[text.index("<!-- plan-jax-example"):]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start:rest.index("```", start)]


@pytest.mark.slow(seconds=120)  # a fresh process, 8 compilations for an H100
def test_docs_example_plans_for_an_h100_without_one(tmp_path):
    """docs/plan.md's JAX example: every step compiled by XLA:GPU for an H100 here, nothing
    run: a plan, said to be one; with no time, the policy that recomputes least among those
    that fit is chosen."""
    script, out = tmp_path / "target.py", tmp_path / "plan.json"
    script.write_text(docs_example() + "\nimport json, sys\n"
                      "json.dump(plan.as_dict(), open(sys.argv[1], 'w'))\n")
    env = plan_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script), str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["target"] == "h100" and record["planned"], record
    assert "XLA's plan for NVIDIA H100 80GB HBM3 (compiled, not run)" in record["memory"]
    assert "This is a plan" in result.stdout and "planned peak GiB" in result.stdout
    assert record["seconds_per_sample"] is None
    assert all(c["seconds_per_sample"] is None for c in record["candidates"])
    fits = [c for c in record["candidates"] if c["micro_batch"] is not None]
    assert record["policy"] == fits[0]["policy"]  # None before "full" when both fit
    for c in fits:
        assert c["measured_peak_mib"] <= BUDGET_GIB * 1024
        if c["refused_batch"] is not None:
            assert c["points"][str(c["refused_batch"])]["peak_mib"] > BUDGET_GIB * 1024
    assert "[recompute.plan]" in result.stderr  # progress
