"""`recompute.ops._feed_forward_jax`: under "full" on JAX a `Dense` with an activation feeding
a `Dense` without one runs as one operation whose gradient keeps the first product and runs
in row blocks. Its value and every gradient are autodiff's (float rounding); it runs in
"full"'s recomputation of a Keras block and of keras-hub's encoder; and XLA:GPU's plan of
its gradient is smaller than autodiff's by the [rows, ffn] tensors it no longer holds."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from recompute import recompute_grad
from recompute.ops import _feed_forward_jax
from tests.helpers.numerics import assert_all_close
from tests.helpers.commands import plan_env
from tests.recompute_jax.test_recompute_jax import stateless_step_seq

ROOT = Path(__file__).resolve().parents[2]


def _reference(activation, x, w1, b1, w2, b2):
    pre = x @ w1 + (0 if b1 is None else b1)
    return activation(pre) @ w2 + (0 if b2 is None else b2)


@pytest.mark.parametrize("rows,biases,activation", [
    (9, True, "gelu"),  # rows not a multiple of the blocks: 2, 2, 2, 3
    (3, False, "relu"),  # fewer rows than blocks: one row each
    (16, True, "gelu_approximate"),
])
def test_value_and_every_gradient_equal_autodiff(rows, biases, activation):
    act = {"gelu": keras.activations.gelu, "relu": keras.activations.relu,
           "gelu_approximate": lambda t: keras.activations.gelu(t, approximate=True)}[activation]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, 6)), "float32")
    w1, w2 = (jnp.asarray(rng.normal(size=s), "float32") for s in ((6, 10), (10, 5)))
    b1, b2 = ((jnp.asarray(rng.normal(size=(10,)), "float32"),
               jnp.asarray(rng.normal(size=(5,)), "float32")) if biases else (None, None))
    weights = jnp.asarray(rng.normal(size=(rows, 5)), "float32")

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(act, *a)) * weights)

    args = (x, w1, b1, w2, b2)
    argnums = (0, 1, 2, 3, 4) if biases else (0, 1, 3)
    value0, grads0 = jax.value_and_grad(loss(_reference), argnums)(*args)
    value1, grads1 = jax.value_and_grad(loss(_feed_forward_jax.feed_forward), argnums)(*args)
    assert abs(float(value0) - float(value1)) <= 1e-6 * abs(float(value0))
    assert_all_close([np.asarray(g) for g in grads0], [np.asarray(g) for g in grads1])
    assert [(a, b) for a, b in _feed_forward_jax._blocks(rows)][-1][1] == rows


def test_bfloat16_is_no_further_from_float32_than_autodiff():
    """In bfloat16 (the weights' gradients summed over the row blocks in float32, rounded
    once): no further from the float32 gradients than autodiff's own bfloat16 ones."""
    rng = np.random.default_rng(0)
    shapes = ((64, 32), (32, 48), (48,), (48, 32), (32,))
    args32 = [jnp.asarray(rng.normal(size=s), "float32") for s in shapes]
    weights = jnp.asarray(rng.normal(size=(64, 32)), "float32")
    act = keras.activations.gelu

    def grads(fn, args):
        def loss(*a):
            return jnp.sum(fn(act, *a).astype("float32") * weights)

        return [np.asarray(g, np.float64) for g in jax.grad(loss, (0, 1, 2, 3, 4))(*args)]

    reference = grads(_reference, args32)
    args16 = [a.astype("bfloat16") for a in args32]
    plain, fused = grads(_reference, args16), grads(_feed_forward_jax.feed_forward, args16)
    assert all(g.dtype == np.float64 for g in fused)

    def error(actual):
        return max(np.abs(r - a).max() / np.abs(r).max() for r, a in zip(reference, actual))

    assert error(fused) <= 1.25 * error(plain), (error(plain), error(fused))


class Block(keras.layers.Layer):
    """A residual feed-forward pair with dropout after it, and a second pair that is not
    one (a dropout between the two `Dense` layers)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(24, activation="gelu")
        self.down = keras.layers.Dense(8)
        self.drop = keras.layers.Dropout(0.2, seed=3)
        self.up2 = keras.layers.Dense(16, activation="relu")
        self.down2 = keras.layers.Dense(8)

    @recompute_grad
    def call(self, x, training=None):
        x = x + self.drop(self.down(self.up(x)), training=training)
        return x + self.down2(self.drop(self.up2(x), training=training))


def test_full_runs_the_pair_as_one_operation_and_stays_exact(monkeypatch):
    seen = []
    original = _feed_forward_jax.feed_forward
    monkeypatch.setattr(_feed_forward_jax, "feed_forward",
                        lambda *a: seen.append(a[0]) or original(*a))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, Block()(Block()(inputs)))
    loss0, grads0, _ = stateless_step_seq(model, False)
    assert not seen  # recomputation off: the layers run as written
    loss1, grads1, _ = stateless_step_seq(model, True)
    # one pair per block (the second has a dropout between its layers), traced once:
    # `jax.checkpoint` traces the call once for both passes
    assert len(seen) == 2 and all(a is keras.activations.gelu for a in seen), seen
    assert abs(loss0 - loss1) <= 1e-6 * abs(loss0)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])


def test_keras_hub_encoder_under_full_runs_the_pair(monkeypatch):
    keras_hub = pytest.importorskip("keras_hub")
    import recompute.keras_hub

    seen = []
    original = _feed_forward_jax.feed_forward
    monkeypatch.setattr(_feed_forward_jax, "feed_forward",
                        lambda *a: seen.append(a[1].shape) or original(*a))
    recompute.keras_hub.patch()
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 16))
        model = keras.Model(inputs, keras_hub.layers.TransformerEncoder(
            intermediate_dim=32, num_heads=2, dropout=0.1)(inputs))
        loss0, grads0, _ = stateless_step_seq(model, False)
        loss1, grads1, _ = stateless_step_seq(model, True)
    finally:
        recompute.keras_hub.unpatch()
    assert seen == [(2, 6, 16)], seen  # traced once, for both passes
    assert abs(loss0 - loss1) <= 1e-6 * abs(loss0)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])


_PLAN = """
import contextlib
from benchmarks import gpu_plan
gpu_plan.prepare_environment()
import jax, keras
from recompute.ops import _feed_forward_jax as F
from recompute.policies import _jax as P
sharding = gpu_plan.target_sharding("h100")
fused, gated = F.fused, P._dropouts_gated
none = lambda layers: contextlib.nullcontext()
small = dict(gpu_plan.DEFAULTS, hidden=64, heads=2, ffn=256, vocab=100)
cases = (  # name, dtype policy, layers, seq, batch, fused, gated
    ("pair", "float32", 2, 128, 32, fused, gated), ("no_pair", "float32", 2, 128, 32, none, gated),
    ("gate", "mixed_bfloat16", 6, 512, 8, fused, gated),
    ("no_gate", "mixed_bfloat16", 6, 512, 8, fused, none))
for name, policy, layers, seq, batch, f, g in cases:
    keras.mixed_precision.set_global_policy(policy)
    F.fused, P._dropouts_gated = f, g
    cfg = dict(small, layers=layers, seq=seq, precision="fp32" if policy == "float32" else "bf16")
    model = gpu_plan.build_model(cfg, "full", "auto")
    print(name, gpu_plan.step_plan(model, cfg, "full", batch, sharding)["temp"])
"""


@pytest.mark.slow(seconds=150)  # a fresh process, 4 compilations for an H100
def test_plan_of_keras_hub_steps_holds_less_with_the_pair_and_the_gated_dropouts():
    """XLA:GPU's plan (H100 target, no GPU) of keras-hub BERT steps under "full" at small
    widths, each with the pair or the gate and without it (`fused` or `_dropouts_gated` a
    no-op). The pair, float32, 2 blocks, seq 128, batch 32: 29,007,784 bytes without it,
    25,869,224 with it (2026-11-29: 0.75 of a [rows, ffn] float32 less; at BERT-base 46.4
    against 56.9 MiB per sample, docs/attention.md). The gate, bfloat16 (Keras's core runs
    and draws the attention's dropout), 6 blocks, seq 512, batch 8: 43,844,520 without it,
    39,000,744 with it (XLA:GPU drew every block's mask at the start of the backward pass:
    at least one [batch, heads, seq, seq] bool more alive)."""
    env = plan_env(KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    temp = {name: int(value) for name, value in (line.split() for line in done.stdout.splitlines()
                                                 if line.split()[0] in ("pair", "no_pair", "gate",
                                                                        "no_gate"))}
    assert temp["pair"] <= temp["no_pair"] - 32 * 128 * 256 * 4 // 2, temp  # [rows, ffn] / 2
    assert temp["gate"] <= temp["no_gate"] - 8 * 2 * 512 * 512, temp  # one mask of bools
