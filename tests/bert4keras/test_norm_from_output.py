"""recompute.bert4keras under "block": a block's last LayerNorm takes its gradient from the
block's output and the recomputation skips the feed-forward's second product
(`recompute.bert4keras._norm_from_output`). Own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1.

The tiny BERT's LayerNorms start at gamma = 1, beta = 0, where taking the normalized input
back from the output is trivial: here they get random gammas (either sign) and betas first."""

import os

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import recompute  # noqa: E402
import recompute.bert4keras as rb  # noqa: E402

rb.patch()

import tensorflow as tf  # noqa: E402

from recompute.bert4keras import _feed_forward, _norm_from_output  # noqa: E402
from tests.helpers import tiny_bert  # noqa: E402
from tests.helpers.numerics import assert_all_close, to_numpy  # noqa: E402


@pytest.fixture
def block_policy():
    rb.patch(policy="block")
    yield
    rb.patch()


def _norms(model):
    """The LayerNormalization layers of `model`, those inside its blocks included."""
    found = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.Model):
            found += _norms(layer)
        elif type(layer).__name__ == "LayerNormalization":
            found.append(layer)
    return found


def _model(config_path, gamma_zero=False):
    """`tiny_bert.classifier` with random LayerNorm gammas (|gamma| in [0.3, 1.7], either
    sign) and betas (in [-0.5, 0.5]); with `gamma_zero`, one entry of each gamma is 0."""
    model = tiny_bert.classifier(config_path)
    rng = np.random.RandomState(3)
    for norm in _norms(model):
        width = norm.gamma.shape[0]
        gamma = rng.uniform(0.3, 1.7, width) * rng.choice([-1.0, 1.0], width)
        if gamma_zero:
            gamma[5] = 0.0
        norm.gamma.assign(gamma.astype(np.float32))
        norm.beta.assign(rng.uniform(-0.5, 0.5, width).astype(np.float32))
    return model


def _batch(samples):
    rng = np.random.RandomState(0)
    token_ids = rng.randint(1, 100, size=(samples, 12))
    token_ids[1, 7:] = 0  # padding
    token_ids[3, 4:] = 0
    return token_ids, np.zeros_like(token_ids), rng.randint(0, 2, samples)


def _steps(config_path, on, mode, cut=None, gamma_zero=False):
    """Two training steps' losses and gradients (recomputation `on`; `mode` "eager",
    "function" or "jit" (XLA); `recompute.batch_cut(cut)`) on 5 samples."""
    token_ids, segment_ids, labels = _batch(5)
    model = _model(config_path, gamma_zero)
    step = tiny_bert.loss_and_gradients(model, labels)
    run = step if mode == "eager" else tf.function(step, jit_compile=mode == "jit")
    with recompute.recompute_scope(on), recompute.batch_cut(cut):
        return [to_numpy(run(tf.constant(token_ids), tf.constant(segment_ids)))
                for _ in range(2)]  # the second step draws new masks


@pytest.mark.slow(seconds=30)  # two traced steps off and on, per case
@pytest.mark.parametrize("mode, cut", [("eager", None), ("function", None), ("function", 2),
                                       ("eager", 2), ("jit", 2)])
def test_gradients_from_the_output_match(dropout_config_path, replayable_rng, block_policy,
                                         monkeypatch, mode, cut):
    """Losses and every gradient equal RECOMPUTE=0's, whole batches and in cuts (2, 2 and a
    rest of 1), with dropout: the recomputation took each block's last LayerNorm from its
    output (`_from_output` ran) and computed no second feed-forward product."""
    reference = _steps(dropout_config_path, False, mode, cut)
    taken, products = [], []
    real_from_output, real_matmul = _norm_from_output._from_output, _feed_forward._matmul_last
    monkeypatch.setattr(_norm_from_output, "_from_output",
                        lambda *a: taken.append(a[0].name) or real_from_output(*a))
    monkeypatch.setattr(_feed_forward, "_matmul_last",
                        lambda x, w, **k: products.append(bool(k)) or real_matmul(x, w, **k))
    recomputed = _steps(dropout_config_path, True, mode, cut)
    for want, got in zip(reference, recomputed):
        assert_all_close(want, got)
    assert set(taken) == {"Transformer-0-FeedForward-Norm", "Transformer-1-FeedForward-Norm"}
    if mode == "function" and cut is None:  # traced once: each block's product once, forward
        assert products.count(False) == 2 and products.count(True) == 2, products


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_zero_gamma_raises(dropout_config_path, block_policy, mode):
    """A gamma with an entry equal to 0 loses that feature's normalized input: the gradient
    raises, naming the layer and the policy that takes it from the input."""
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?s)Transformer-1-FeedForward-Norm.*block_keep_ffn"):
        _steps(dropout_config_path, True, mode, gamma_zero=True)


def test_a_zero_gamma_under_xla_gives_nan(dropout_config_path, block_policy):
    """Under XLA an assert does nothing (documented): the gradients are NaN, not wrong numbers."""
    results = _steps(dropout_config_path, True, "jit", gamma_zero=True)[0]
    assert np.isfinite(results[0])  # the loss
    assert any(np.isnan(g).any() for g in results[1:])


def test_block_keep_ffn_takes_the_gradient_from_the_input(dropout_config_path, replayable_rng):
    """Only "block" marks its blocks; under "block_keep_ffn" (the product kept) a zero gamma
    is fine and the gradients equal RECOMPUTE=0's."""
    rb.patch(policy="block_keep_ffn")
    try:
        results = [_steps(dropout_config_path, on, "function", gamma_zero=True)[0]
                   for on in (False, True)]
        model = tiny_bert.classifier(dropout_config_path)
    finally:
        rb.patch()
    assert not any(_norm_from_output.MARK_ATTR in vars(n) for n in _norms(model))
    assert_all_close(results[0], results[1])


def _tail_model(wiring):
    """A functional model of bert4keras's layers: x -> FeedForward -> Dropout -> Add(x, .) ->
    LayerNormalization, wired as `wiring` says ("bert", "two outputs", "ffn read twice",
    "conditional norm")."""
    from bert4keras.layers import FeedForward, LayerNormalization

    x = tf.keras.Input((6, 8))
    o = FeedForward(16, activation="gelu", name="ff")(x)
    d = tf.keras.layers.Dropout(0.1)(o)
    z = tf.keras.layers.Add()([x, d])
    if wiring == "ffn read twice":
        z = tf.keras.layers.Add()([z, o])
    y = LayerNormalization(offset=wiring != "norm without beta", name="norm")(z)
    outputs = [y, o] if wiring == "two outputs" else y
    return tf.keras.Model(x, outputs)


@pytest.mark.parametrize("wiring, marked", [
    ("bert", True), ("two outputs", False), ("ffn read twice", False),
    ("norm without beta", False)])
def test_mark_finds_only_bert_wiring(block_policy, wiring, marked):
    model = _tail_model(wiring)
    assert _norm_from_output.mark(model, tf.keras) is marked
    layers = {layer.name: layer for layer in model.layers}
    assert (_norm_from_output.MARK_ATTR in vars(layers["norm"])) is marked
    assert (_norm_from_output.MARK_ATTR in vars(layers["ff"])) is marked


def test_patched_blocks_are_marked(dropout_config_path, block_policy):
    model = tiny_bert.classifier(dropout_config_path)
    marked = {n.name for n in _norms(model) if _norm_from_output.MARK_ATTR in vars(n)}
    assert marked == {"Transformer-0-FeedForward-Norm", "Transformer-1-FeedForward-Norm"}
