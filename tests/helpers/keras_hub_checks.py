"""Checks of `recompute.keras_hub`, run on Keras's TensorFlow backend (tests/recompute_keras3)
and on JAX (tests/recompute_jax). Backend-neutral: they train with `train_on_batch`.

Exactness is checked on gradients: one SGD step with a large learning rate from the same
state (weights and seed-generator states) with RECOMPUTE off and on; the weight change
divided by the learning rate is the gradient, compared for every variable.

Steps compiled before `patch()` (issue 35): a model fitted, then patched (from a callback of
a running `fit` too), switched or unpatched, traces its next step anew -- counted by the runs
of keras-hub's own `TransformerEncoder.call` and the recomputations started, which do not
move while a step traced before is reused.

The `test_*` functions (and the fixture `reference`) are the tests of both suites,
written once: tests/recompute_keras3/test_keras_hub.py and
tests/recompute_jax/test_keras_hub_jax.py import them (`__all__`).
"""

import contextlib
import functools
import re

import keras
import numpy as np
import pytest

from recompute import recompute_scope
from tests.helpers.numerics import assert_all_close

LR = 1000.0


def tiny_backbone(seed=0):
    import keras_hub

    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertBackbone(
        vocabulary_size=60, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=12, dropout=0.1,
    )


def batch(vocab=60, size=4, seq=12, seed=1):
    """Token ids, segment ids and a padding mask with padded tails of different lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(size, seq)).astype("int32")
    lengths = np.linspace(seq // 3, seq, size).astype(int)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    segments = (np.arange(seq)[None, :] >= lengths[:, None] // 2).astype("int32") * mask
    x = {"token_ids": ids, "segment_ids": segments.astype("int32"), "padding_mask": mask}
    y = (np.arange(size) % 2).astype("int32")
    return x, y


def classifier(backbone):
    inputs = {name: keras.Input((None,), dtype=dtype, name=name) for name, dtype in
              (("token_ids", "int32"), ("segment_ids", "int32"), ("padding_mask", "bool"))}
    pooled = backbone(inputs)["pooled_output"]
    logits = keras.layers.Dense(2)(keras.layers.Dropout(0.1, seed=3)(pooled))
    return keras.Model(inputs, logits)


def gradients_by_step(model, x, y, on):
    """(gradient of every trainable variable, the variables after the step) of one SGD step,
    starting from the model's current state, which is restored afterwards."""
    start = [np.array(v.numpy()) for v in model.variables]
    model.compile(keras.optimizers.SGD(LR), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [np.array(v.numpy(), np.float64) for v in model.trainable_variables]
    with recompute_scope(on):
        model.train_on_batch(x, y)
    after = [np.array(v.numpy(), np.float64) for v in model.trainable_variables]
    state = [np.array(v.numpy()) for v in model.non_trainable_variables]
    for v, value in zip(model.variables, start):
        v.assign(value)
    return [(b - a) / LR for a, b in zip(after, before)], state


def check_recompute_exact(model, x, y):
    """RECOMPUTE=1 gives RECOMPUTE=0's gradients (every variable) and state (dropout seeds)."""
    grads0, state0 = gradients_by_step(model, x, y, False)
    grads1, state1 = gradients_by_step(model, x, y, True)
    names = [v.path for v in model.trainable_variables]
    assert_all_close(grads0, grads1, names)
    for a, b in zip(state0, state1):
        np.testing.assert_array_equal(a, b)
    # The step trained the encoder: the comparison is not between zeros.
    encoder = [g for g, n in zip(grads0, names) if "transformer_layer_0" in n]
    assert encoder and all(np.abs(g).max() > 0 for g in encoder)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_patch_is_exact_and_reversible(policy):
    """Patched, a tiny BertBackbone (dropout 0.1, padding) built before and one built after
    `patch()` both recompute exactly; `unpatch()` restores keras-hub's own call."""
    import keras_hub

    import recompute.keras_hub as hub

    encoder = keras_hub.layers.TransformerEncoder
    original = encoder.__dict__["call"]
    x, y = batch()
    built_before = classifier(tiny_backbone(0))
    try:
        hub.patch(policy=policy)
        hub.patch(policy=policy)  # idempotent
        assert hub.is_patched() == policy
        assert encoder.__dict__["call"].__recompute_grad_wrapped__ is original
        check_recompute_exact(built_before, x, y)
        check_recompute_exact(classifier(tiny_backbone(1)), x, y)
    finally:
        hub.unpatch()
    assert encoder.__dict__["call"] is original and hub.is_patched() is None
    hub.unpatch()  # nothing to undo


@contextlib.contextmanager
def _counted_encoder_calls(monkeypatch):
    """Counts, while active, the runs of keras-hub's own `TransformerEncoder.call` (the
    original under `patch()`: traced or eager, forward or recomputation) and the calls that
    start a recomputation: yields {"calls": n, "recomputed": n}. Neither moves while a step
    traced before runs: they count what a step traced (or ran) anew does."""
    import keras_hub

    from tests.helpers.keras_hub_decoder_checks import _recomputed_calls

    encoder = keras_hub.layers.TransformerEncoder
    own = encoder.__dict__["call"]
    seen = {"calls": 0, "recomputed": 0}

    @functools.wraps(own)
    def call(*args, **kwargs):
        seen["calls"] += 1
        return own(*args, **kwargs)

    monkeypatch.setattr(encoder, "call", call)  # before `patch()`: it wraps this one
    with _recomputed_calls() as count:
        yield seen, count


def _fit(model, x, y, on, seen=None, count=None):
    """One epoch of one step with RECOMPUTE `on`: (calls of the encoder's own `call`,
    recomputations started) during it."""
    before = (seen["calls"], count[0]) if seen is not None else (0, 0)
    with recompute_scope(on):
        model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    return (seen["calls"] - before[0], count[0] - before[1]) if seen is not None else None


def _one_block_classifier():
    """`classifier` of a one-block `tiny_backbone` (seed 0), compiled with SGD (each trace of
    a step costs seconds on JAX: one block, not two)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    model = classifier(keras_hub.models.BertBackbone(
        vocabulary_size=60, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=12, dropout=0.1))
    model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_patch_after_fit_recomputes_at_the_next_fit(monkeypatch):
    """A model fitted (its step traced) before `patch()` recomputes at its next `fit`: the
    step is traced anew, and the weights are those of a model trained without recomputation
    (issue 35 item 3: the step traced before `patch()` was reused, recomputing nothing)."""
    import recompute.keras_hub as hub

    x, y = batch()
    with _counted_encoder_calls(monkeypatch) as (seen, count):
        model = _one_block_classifier()
        reference = _one_block_classifier()
        for a, b in zip(reference.variables, model.variables):
            a.assign(np.array(b.numpy()))  # weights and seed states (a copy: JAX donates)
        for m in (model, reference):
            _fit(m, x, y, True)  # traced unpatched
        try:
            hub.patch()
            assert len(hub.covered(model)) == 1  # it lists the block ...
            calls, recomputed = _fit(model, x, y, True, seen, count)
            assert calls > 0 and recomputed > 0, (calls, recomputed)  # ... and it recomputes
        finally:
            hub.unpatch()
        _fit(reference, x, y, False)
    names = [v.path for v in model.trainable_variables]
    assert_all_close([v.numpy() for v in reference.trainable_variables],
                     [v.numpy() for v in model.trainable_variables], names)
    for a, b in zip(reference.non_trainable_variables, model.non_trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_patch_in_a_running_fit_a_switch_and_unpatch_retrace_the_steps(monkeypatch):
    """`patch()` from a callback of a running `fit` (after its first step): the next step is
    traced anew and recomputes; the `evaluate` step traced before `patch()` is traced anew;
    after a policy switch the `train_on_batch` step, after `unpatch()` the `fit` step, which
    recomputes no more (each reused the step traced before, issue 35 item 3)."""
    import recompute.keras_hub as hub

    x, y = batch()
    two_steps = {k: np.concatenate([v, v]) for k, v in x.items()}, np.concatenate([y, y])

    class PatchAfterFirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            if step == 0:
                hub.patch()
                self.recomputed = count[0]

    with _counted_encoder_calls(monkeypatch) as (seen, count):
        model = _one_block_classifier()
        model.evaluate(x, y, verbose=0)
        callback = PatchAfterFirstStep()
        try:
            with recompute_scope(True):
                model.fit(*two_steps, batch_size=len(y), epochs=1, shuffle=False, verbose=0,
                          callbacks=[callback])
            assert count[0] > callback.recomputed  # its second step
            before = seen["calls"]
            model.evaluate(x, y, verbose=0)
            assert seen["calls"] > before
            hub.patch(policy="attention")
            before = count[0]
            with recompute_scope(True):
                model.train_on_batch(x, y)
            assert count[0] > before
        finally:
            hub.unpatch()
        calls, recomputed = _fit(model, x, y, True, seen, count)
        assert calls > 0 and recomputed == 0, (calls, recomputed)


@pytest.mark.parametrize("model", [None, "bert", keras.Model], ids=["None", "str", "class"])
def test_covered_refuses_what_is_not_a_keras_layer(model):
    """`covered(None)` (a string, a model class) says what it takes (issue 35 item 7: it
    raised `AttributeError: 'NoneType' object has no attribute '_flatten_layers'`)."""
    import recompute.keras_hub as hub

    with pytest.raises(TypeError, match=r"`model` must be a Keras model or layer.*Received: model="
                                        + re.escape(repr(model))):
        hub.covered(model)


def test_covered_takes_any_keras_layer():
    """`covered` of a plain Keras layer lists nothing and warns; of a block itself, the block."""
    import keras_hub

    import recompute.keras_hub as hub

    block = keras_hub.layers.TransformerEncoder(intermediate_dim=8, num_heads=1)
    hub.patch()
    try:
        with pytest.warns(UserWarning, match="'plain' has no block"):
            assert hub.covered(keras.layers.Dense(2, name="plain")) == []
        assert hub.covered(block) == [block]
    finally:
        hub.unpatch()


def numpy_reference():
    """The NumPy BERT of the MiniLM package's weights, with the GELU keras-hub computes
    (skips the test if the package is not installed)."""
    from recompute.bert4keras.converter import minilm_zip
    from tests.helpers import numpy_bert

    try:
        src = minilm_zip()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    config, weights = numpy_bert.load_hf(src)
    # keras-hub's BertBackbone always uses the tanh GELU (MiniLM was trained with the erf
    # one: keras-hub's outputs differ from the original model's by ~4e-4 of their scale).
    return numpy_bert.NumpyBert(dict(config, hidden_act="gelu_new"), weights)


@pytest.fixture(scope="module")
def reference():
    return numpy_reference()


def test_minilm_preset_matches_numpy_bert_and_recomputes_exactly(tmp_path, reference):
    """The real MiniLM, loaded by keras-hub from the preset directory, matches the NumPy BERT
    (≤ 1e-4 on every real token), and recomputes exactly when patched."""
    import keras_hub

    import recompute.keras_hub as hub

    path = hub.minilm_preset(tmp_path / "minilm")
    backbone = keras_hub.models.BertBackbone.from_preset(path)
    tokenizer = keras_hub.models.BertTokenizer.from_preset(path)
    ids = [list(tokenizer(s).numpy() if hasattr(tokenizer(s), "numpy") else tokenizer(s))
           for s in ["a gripping , funny film .", "flat and dull"]]
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    seq = 12
    tokens = np.zeros((2, seq), "int32")
    for i, row in enumerate(ids):
        row = [cls] + [int(t) for t in row] + [sep]
        tokens[i, :len(row)] = row
    mask = tokens != 0
    out = backbone({"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": mask})
    got = np.asarray(keras.ops.convert_to_numpy(out["sequence_output"]), np.float64)
    want, _ = reference(tokens, None, mask.astype("int32"))
    err = np.abs(got - want)[mask].max() / np.abs(want[mask]).max()
    assert err <= 1e-4, err
    try:
        hub.patch()
        model = classifier(backbone)
        check_recompute_exact(model, {"token_ids": tokens, "segment_ids": np.zeros_like(tokens),
                                      "padding_mask": mask}, np.array([1, 0], "int32"))
    finally:
        hub.unpatch()


# what the suites import: the tests and the fixture `reference`
__all__ = [name for name in dir() if name.startswith("test_")] + ["reference"]
