"""`recompute.batch_cut` and `recompute.engine._jax._by_samples`: under "full" on JAX a
recomputed block of Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers runs
its batch in cuts, in both passes. Its loss and every gradient equal RECOMPUTE=0's (float
rounding: the weights' gradients are summed over the cuts), its dropouts drawing the whole
batch's numbers cut to each cut; a call that adds a loss runs whole; XLA:GPU's plan of a
step holds less with the cuts than without."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import recompute
from recompute import recompute_grad
from recompute.engine._batch_cut import CUT_ROWS, samples_per_cut
from recompute.engine import _running
from recompute.ops import _feed_forward_jax
from tests.helpers.numerics import assert_all_close
from tests.helpers.commands import plan_env
from tests.recompute_jax.test_recompute_jax import stateless_step_seq as _step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _whole_batches_after():
    yield
    recompute.batch_cut(None)


def _hub_encoder():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    tokens, padding = keras.Input((8, 16)), keras.Input((8,), dtype="int32")
    h = tokens
    for _ in range(2):
        h = keras_hub.layers.TransformerEncoder(intermediate_dim=32, num_heads=2,
                                                dropout=0.1)(h, padding_mask=padding)
    return keras.Model([tokens, padding], h)


class KerasBlock(keras.layers.Layer):
    """A standard Keras 3 block: attention, two LayerNormalizations, a feed-forward pair,
    dropouts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, seed=1)
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()
        self.up, self.down = keras.layers.Dense(32, activation="gelu"), keras.layers.Dense(16)
        self.drop = keras.layers.Dropout(0.1, seed=2)

    @recompute_grad
    def call(self, x, training=None):
        return self.body(x, training)

    def body(self, x, training):
        x = self.norm1(x + self.drop(self.attention(x, x, training=training), training=training))
        return self.norm2(x + self.drop(self.down(self.up(x)), training=training))


def _keras_block_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    return keras.Model(inputs, KerasBlock()(KerasBlock()(inputs)))


def _inputs(model, batch):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(batch, 8, 16)).astype("float32")
    if len(model.inputs) == 1:
        return x
    padding = np.ones((batch, 8), "int32")
    padding[:, 6:] = 0
    padding[1, 3:] = 0
    return [x, padding]


def _seen_pairs(monkeypatch):
    """The input shapes of each feed-forward pair traced (one per cut size per block)."""
    seen = []
    original = _feed_forward_jax.feed_forward
    monkeypatch.setattr(_feed_forward_jax, "feed_forward",
                        lambda *a: seen.append(tuple(a[1].shape)) or original(*a))
    return seen


@pytest.mark.parametrize("build,batch,offload", [
    (_hub_encoder, 5, False), (_keras_block_model, 5, False), (_hub_encoder, 4, False),
    (_keras_block_model, 4, False), (_hub_encoder, 5, True),
], ids=["keras_hub-rest", "keras-rest", "keras_hub-even", "keras-even", "keras_hub-offload"])
def test_cuts_equal_recompute_off(monkeypatch, build, batch, offload):
    """Cuts of 2 samples (5: two cuts and a rest of 1; 4: two cuts), with padding and
    dropout: the loss and every gradient equal RECOMPUTE=0's, the seed states advance alike,
    and the pair ran on the cuts' shapes, not the batch's."""
    import recompute.keras_hub

    model = build()
    inputs = _inputs(model, batch)
    loss0, grads0, state0 = _step(model, False, inputs)
    seen = _seen_pairs(monkeypatch)
    if build is _hub_encoder:  # (the Keras block's own decorator: "full", no offload)
        recompute.keras_hub.patch(offload=offload)
    try:
        with recompute.batch_cut(2):
            loss1, grads1, state1 = _step(model, True, inputs)
    finally:
        recompute.keras_hub.unpatch()
    expected = [(2, 8, 16)] + ([(batch % 2, 8, 16)] if batch % 2 else [])
    assert seen == expected * 2, seen  # each block: the cut, then the rest
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])
    assert all(np.array_equal(a, b) for a, b in zip(state0, state1))


def test_the_window_is_what_draws_the_batch_dropout(monkeypatch):
    """Without the window (each cut drawing its own numbers) the loss is another: the
    comparison above sees the dropouts."""
    import recompute.keras_hub

    model = _hub_encoder()
    inputs = _inputs(model, 5)
    loss0, _, _ = _step(model, False, inputs)
    monkeypatch.setattr(_running, "batch_window", lambda: None)
    recompute.keras_hub.patch()
    try:
        with recompute.batch_cut(2):
            loss1, _, _ = _step(model, True, inputs)
    finally:
        recompute.keras_hub.unpatch()
    assert abs(loss0 - loss1) > 1e-3 * abs(loss0), (loss0, loss1)


class LossBlock(KerasBlock):
    """A block whose call adds a loss: it runs whole."""

    @recompute_grad
    def call(self, x, training=None):
        y = self.body(x, training)
        self.add_loss(jnp.mean(y**2))
        return y


@pytest.mark.fast
def test_a_call_that_adds_a_loss_runs_whole(monkeypatch):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    model = keras.Model(inputs, LossBlock()(inputs))
    x = _inputs(model, 5)
    seen = _seen_pairs(monkeypatch)
    with recompute.batch_cut(2):
        _step(model, True, x)
    assert seen == [(2, 8, 16), (5, 8, 16)], seen  # traced at a cut, found the loss: whole


def test_setting_rule_and_errors():
    assert samples_per_cut(512) == CUT_ROWS // 512 == 8
    assert samples_per_cut(10**6) == 1
    with recompute.batch_cut(0):
        assert samples_per_cut(512) is None
        with recompute.batch_cut(3):
            assert samples_per_cut(512) == 3
        assert samples_per_cut(512) is None
    assert samples_per_cut(512) == 8
    for bad in (2.5, -1, True, "4"):
        with pytest.raises(ValueError, match=r"`samples` must be an integer >= 0 or None\. "
                                             r"Received: samples="):
            recompute.batch_cut(bad)


def test_docstring_example():
    """The docstring's example runs; docs/jax.md shows the same one."""
    example = textwrap.dedent(recompute.batch_cut.__doc__.split("```python\n")[1].split("```")[0])
    page = (ROOT / "docs" / "jax.md").read_text()
    assert example in [block.split("```")[0] for block in page.split("```python\n")[1:]]
    example = example.replace("    ...\n", "    assert samples_per_cut(512) is None\n")
    exec(compile(example, "batch_cut.__doc__", "exec"),
         {"samples_per_cut": samples_per_cut})
    assert samples_per_cut(512) == 4


_PLAN = """
from benchmarks import gpu_plan
gpu_plan.prepare_environment()
import recompute
sharding = gpu_plan.target_sharding("h100")
cfg = dict(gpu_plan.DEFAULTS, layers=2, hidden=64, heads=2, ffn=256, seq=128, vocab=100)
for samples in (0, 4):
    recompute.batch_cut(samples)
    model = gpu_plan.build_model(cfg, "full", "auto")
    print("cut", samples, gpu_plan.step_plan(model, cfg, "full", 32, sharding)["temp"])
"""


def test_plan_of_a_keras_hub_step_holds_less_with_cuts():
    """XLA:GPU's plan (H100 target, no GPU) of a keras-hub BERT step under "full", 2 blocks,
    hidden 64, FFN 256, seq 128, batch 32, whole batches against cuts of 4 samples (at
    BERT-base, 8 and 32: 46.4 against 25.4 MiB per sample, docs/attention.md). Measured
    2026-11-29: 25,869,736 bytes whole, 8,551,736 in cuts. The cut step holds at least
    three [batch, seq, ffn] floats less (12.6 MB): a block's working set is one cut's."""
    env = plan_env(KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    temp = {int(words[1]): int(words[2]) for words in
            (line.split() for line in done.stdout.splitlines()) if words and words[0] == "cut"}
    assert temp[4] <= temp[0] - 3 * 32 * 128 * 256 * 4, temp
