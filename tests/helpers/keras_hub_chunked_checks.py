"""`recompute.keras_hub.chunked_loss` (issue 38) on a keras-hub causal LM, run on Keras's
TensorFlow backend (tests/recompute_keras3/test_keras_hub_chunked_loss.py) and on JAX
(tests/recompute_jax/test_keras_hub_chunked_loss_jax.py), which import the `test_*`
functions (`__all__`). Tiny models built from configs (no downloads), float32.

- `test_loss_and_every_gradient_equal_full_logits`: Gemma (tied head), Gemma 2-style
  (`final_logit_soft_cap`), Llama (untied `reverse_embeddings`) and GPT-2, chunks that
  divide the 24 tokens (4), do not (5, 7) and the default; padded tails masked by the
  sample weights, the weights not all 1: the loss and the gradient of every trainable
  weight (the embedding's included) equal keras-hub's full-logit loss (<= 1e-5).
- `test_reductions_and_no_sample_weights`: Keras's other reductions; no sample weights.
- `test_fit_with_lora_and_accumulation_equals_full_logits`: LoRA (rank 2) +
  `AccumOptimizer(Adam, 2)`, `fit` over 3 updates, with `recompute.keras_hub.patch()`
  under `"full"` and `"attention"`: every LoRA weight, the loss and accuracy logs equal
  the full-logit fit's; the frozen weights untouched.
- `test_evaluate_and_accuracy_equal_full_logits`: `evaluate` and `test_on_batch`, an
  accuracy well away from 0 and 1, with and without sample weights.
- `test_documented_example_runs_as_written`: the examples of docs/keras_hub.md and of
  `chunked_loss`' docstring, with a tiny model for the preset.
- `test_predict_unchanged`, `test_compile_again_drops_it`, `test_refusals`,
  `test_private_names_exist`, `test_mixed_precision_fit_runs`.
"""

import keras
import numpy as np
import pytest

from tests.helpers.numerics import assert_all_close

V, SEQ, N = 48, 8, 3

__all__ = [
    "test_loss_and_every_gradient_equal_full_logits", "test_reductions_and_no_sample_weights",
    "test_fit_with_lora_and_accumulation_equals_full_logits",
    "test_evaluate_and_accuracy_equal_full_logits", "test_predict_unchanged",
    "test_compile_again_drops_it", "test_refusals", "test_private_names_exist",
    "test_mixed_precision_fit_runs", "test_every_documented_example_is_run",
    "test_documented_example_runs_as_written",
]


def tiny(family="gemma", seed=0, dropout=0.0):
    """A tiny keras-hub causal LM of `family`, float32, no preprocessor."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    common = dict(vocabulary_size=V, num_layers=2, hidden_dim=16, intermediate_dim=32,
                  dropout=dropout, dtype="float32")
    if family in ("gemma", "gemma2"):
        extra = dict(final_logit_soft_cap=3.0, attention_logit_soft_cap=50.0,
                     use_post_ffw_norm=True, use_post_attention_norm=True) if family == "gemma2" else {}
        backbone = m.GemmaBackbone(num_query_heads=2, num_key_value_heads=1, head_dim=8,
                                   **common, **extra)
        return m.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if family == "llama":
        backbone = m.LlamaBackbone(num_query_heads=2, num_key_value_heads=1, **common)
        return m.LlamaCausalLM(backbone=backbone, preprocessor=None)
    backbone = m.GPT2Backbone(num_heads=2, max_sequence_length=SEQ, **common)
    return m.GPT2CausalLM(backbone=backbone, preprocessor=None)


def data(lm=None, n=N, seed=1):
    """(x, y, sample_weight): padded tails (weight 0), the other weights in [0.5, 1.5]; where
    `lm` is given, about half the targets are its arg-max (an accuracy away from 0)."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(SEQ // 2, SEQ + 1, n).astype(int)
    mask = np.arange(SEQ + 1)[None, :] < lengths[:, None]
    ids = np.where(mask, rng.integers(1, V, size=(n, SEQ + 1)), 0).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y = ids[:, 1:].copy()
    if lm is not None:
        best = np.argmax(np.asarray(lm.predict(x, verbose=0)), axis=-1)
        y = np.where(rng.random(y.shape) < 0.5, best, y).astype("int32")
    weight = mask[:, 1:] * rng.uniform(0.5, 1.5, size=y.shape)
    return x, y, weight.astype("float32")


def loss_and_grads(lm, x, y, weight, chunked):
    """The model's `compute_loss` in training and the gradient of every trainable weight,
    with the chunked head on (as inside its `train_step`) or keras-hub's full logits."""
    import contextlib

    from recompute.keras_hub import _chunked

    scope = _chunked._on(lm) if chunked else contextlib.nullcontext()
    if keras.backend.backend() == "jax":
        import jax

        trainable = [v.value for v in lm.trainable_variables]
        rest = [v.value for v in lm.non_trainable_variables]
        metrics = [v.value for v in lm.metrics_variables]
        optimizer = [v.value for v in lm.optimizer.variables]

        def loss_fn(values):
            with scope:
                loss, _ = lm.compute_loss_and_updates(values, rest, metrics, x, y, weight,
                                                      training=True, optimizer_variables=optimizer)
            return loss

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        return float(loss), [np.asarray(g) for g in grads]
    import tensorflow as tf

    with tf.GradientTape() as tape, scope:
        y_pred = lm(x, training=True)
        weight = None if weight is None else keras.ops.convert_to_tensor(weight)
        loss = lm.compute_loss(x, y, y_pred, weight, training=True)
    grads = tape.gradient(loss, lm.trainable_variables)
    return float(loss), [None if g is None else np.asarray(tf.convert_to_tensor(g)) for g in grads]


def _chunked_lm(family="gemma", chunk_tokens=None, **compile_kwargs):
    import recompute.keras_hub as hub

    lm = tiny(family)
    lm.compile(**compile_kwargs)
    return hub.chunked_loss(lm, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("family,chunk", [
    ("gemma", 4), ("gemma", 5), ("gemma2", 7), ("gemma2", None), ("llama", 5), ("gpt2", 7)])
def test_loss_and_every_gradient_equal_full_logits(family, chunk):
    lm = _chunked_lm(family, chunk)
    x, y, weight = data()
    loss0, grads0 = loss_and_grads(lm, x, y, weight, chunked=False)
    loss1, grads1 = loss_and_grads(lm, x, y, weight, chunked=True)
    names = [v.path for v in lm.trainable_variables]
    assert any("embedding" in n for n in names), names
    assert_all_close([np.array(loss0)] + grads0, [np.array(loss1)] + grads1, ["loss"] + names)


@pytest.mark.fast
@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", "no sample weights"])
def test_reductions_and_no_sample_weights(reduction):
    if reduction == "no sample weights":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    lm = _chunked_lm("gemma2", 5, loss=loss)
    x, y, weight = data()
    if reduction == "no sample weights":
        weight = None
    loss0, grads0 = loss_and_grads(lm, x, y, weight, chunked=False)
    loss1, grads1 = loss_and_grads(lm, x, y, weight, chunked=True)
    assert_all_close([np.array(loss0)] + grads0, [np.array(loss1)] + grads1)


def _lora_fit(chunked, policy):
    import recompute.keras_hub as hub
    from accum import AccumOptimizer
    from recompute import recompute_scope

    lm = tiny("gemma")
    lm.backbone.enable_lora(2)
    rng = np.random.default_rng(0)
    for v in lm.trainable_variables:
        if v.path.endswith("lora_kernel_b"):
            v.assign(rng.normal(scale=0.3, size=v.shape).astype("float32"))
    frozen = [np.array(v.numpy()) for v in lm.non_trainable_weights]
    lm.compile(optimizer=AccumOptimizer(keras.optimizers.Adam(0.01), 2))
    if chunked:
        hub.chunked_loss(lm, chunk_tokens=5)
    x, y, weight = data(n=12, seed=2)
    try:
        hub.patch(policy)
        with recompute_scope(True):
            history = lm.fit(x, y, sample_weight=weight, batch_size=2, epochs=1, shuffle=False,
                             verbose=0)
    finally:
        hub.unpatch()
    for a, v in zip(frozen, lm.non_trainable_weights):
        np.testing.assert_array_equal(a, v.numpy())
    return [np.array(v.numpy()) for v in lm.trainable_variables], history.history


@pytest.mark.parametrize("policy", ["full", pytest.param("attention", marks=pytest.mark.slow)])
def test_fit_with_lora_and_accumulation_equals_full_logits(policy):
    lora0, logs0 = _lora_fit(False, policy)
    lora1, logs1 = _lora_fit(True, policy)
    assert_all_close(lora0, lora1)
    assert sorted(logs0) == sorted(logs1) == ["loss", "sparse_categorical_accuracy"]
    for key in logs0:
        np.testing.assert_allclose(logs0[key], logs1[key], rtol=1e-5)


def test_evaluate_and_accuracy_equal_full_logits():
    import recompute.keras_hub as hub

    lm = tiny("gemma2")
    lm.compile()
    x, y, weight = data(lm)
    for sample_weight in (weight, None):
        full = lm.evaluate(x, y, sample_weight=sample_weight, verbose=0, return_dict=True)
        assert 0.2 < full["sparse_categorical_accuracy"] < 0.9, full
        hub.chunked_loss(lm, chunk_tokens=5)
        chunked = lm.evaluate(x, y, sample_weight=sample_weight, verbose=0, return_dict=True)
        on_batch = lm.test_on_batch(x, y, sample_weight=sample_weight, return_dict=True)
        lm.compile()  # drops it
        for got in (chunked, on_batch):
            assert sorted(got) == sorted(full)
            for key in full:
                np.testing.assert_allclose(got[key], full[key], rtol=1e-5, err_msg=key)


def test_predict_unchanged():
    lm = tiny("gemma")
    lm.compile()
    x, _, _ = data()
    before = np.asarray(lm.predict(x, verbose=0))
    import recompute.keras_hub as hub

    hub.chunked_loss(lm, chunk_tokens=3)
    after = np.asarray(lm.predict(x, verbose=0))
    assert after.shape == (N, SEQ, V)
    np.testing.assert_array_equal(before, after)
    np.testing.assert_allclose(np.asarray(lm(x)), before, rtol=1e-5, atol=1e-6)  # eager: logits


def test_compile_again_drops_it():
    import recompute.keras_hub as hub

    lm = _chunked_lm("gemma", 4)
    assert hub.is_chunked(lm) == 4
    hub.chunked_loss(lm, chunk_tokens=6)  # again: a new chunk size
    assert hub.is_chunked(lm) == 6
    lm.compile(optimizer=keras.optimizers.SGD(0.1))
    assert hub.is_chunked(lm) is None
    for name in ("call", "compute_loss", "compute_metrics", "train_step", "test_step", "compile"):
        assert name not in vars(lm), name
    x, y, weight = data()
    lm.train_on_batch(x, y, sample_weight=weight)  # keras-hub's own step
    from recompute.keras_hub import _head

    assert hub.is_chunked(hub.chunked_loss(lm)) == _head.default_chunk_tokens(V)
    assert _head.default_chunk_tokens(256000) == 520 and _head.default_chunk_tokens(50257) == 2664


def test_refusals():
    import recompute.keras_hub as hub

    lm = tiny("gemma")  # keras-hub's tasks compile themselves when built: as if not
    lm.compiled = False
    with pytest.raises(ValueError, match="needs a compiled `CausalLM`"):
        hub.chunked_loss(lm)
    lm.compile()
    for bad in (0, -1, 2.5, True, "64"):
        with pytest.raises(ValueError, match=(
                r"`chunk_tokens` must be an integer >= 1 or None\. "
                rf"Received: chunk_tokens={bad!r}".replace("(", r"\(").replace(")", r"\)"))):
            hub.chunked_loss(lm, chunk_tokens=bad)
    with pytest.raises(ValueError, match=r"chunk_tokens=0$"):
        hub.chunked_loss(lm, chunk_tokens=0)
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="needs a keras-hub `CausalLM`"):
        hub.chunked_loss(dense)
    lm.compile(loss=keras.losses.SparseCategoricalCrossentropy())  # probabilities
    with pytest.raises(ValueError, match="from_logits=True"):
        hub.chunked_loss(lm)
    lm.compile(weighted_metrics=[keras.metrics.SparseTopKCategoricalAccuracy()])
    with pytest.raises(ValueError, match="other metrics would need the full logits"):
        hub.chunked_loss(lm)
    lm.compile(loss_weights=2.0)
    with pytest.raises(ValueError, match="loss_weights"):
        hub.chunked_loss(lm)
    assert hub.is_chunked(lm) is None


def test_private_names_exist():
    from recompute.keras_hub import _private

    lm = tiny("gemma")
    lm.compile()
    for attribute, _ in _private.PRIVATE_NAMES:
        owner = lm.outputs[0] if attribute == "_keras_history" else lm
        assert hasattr(owner, attribute), attribute
    import importlib

    for name, module in _private.PRIVATE_MODULE_NAMES:
        assert hasattr(importlib.import_module(module), name), (module, name)
    assert _private.functional_call() is type(lm).call
    assert _private.compile_metrics(lm) is not None
    assert _private.compile_arguments(lm)["loss_weights"] is None
    layer, node = _private.made_by(lm.outputs[0])
    assert layer is lm.backbone.token_embedding and node.arguments.kwargs == {"reverse": True}


def test_mixed_precision_fit_runs():
    """Under `mixed_bfloat16` the chunked step trains and its loss is keras-hub's to bfloat16
    rounding (the logits are bfloat16 in both; the loss float32)."""
    import recompute.keras_hub as hub

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        import keras_hub

        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=V, num_layers=1, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.SGD(0.0))
        x, y, weight = data()
        full = lm.evaluate(x, y, sample_weight=weight, verbose=0, return_dict=True)
        hub.chunked_loss(lm, chunk_tokens=5)
        logs = lm.train_on_batch(x, y, sample_weight=weight, return_dict=True)
        np.testing.assert_allclose(logs["loss"], full["loss"], rtol=2e-2)
    finally:
        keras.config.set_dtype_policy(previous)


def documented_examples():
    """(where, code) of every Python example that calls `chunked_loss`: docs/keras_hub.md,
    README.md and `chunked_loss`' docstring."""
    import os
    import re
    import textwrap

    import recompute.keras_hub as hub

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    blocks = []
    for page in ("docs/keras_hub.md", "README.md"):
        with open(os.path.join(root, page)) as f:
            blocks += [(page, b) for b in re.findall(r"```python\n(.*?)```", f.read(), re.S)]
    blocks += [("chunked_loss.__doc__", textwrap.dedent(b)) for b in re.findall(
        r"```python\n(.*?)```", textwrap.dedent(hub.chunked_loss.__doc__), re.S)]
    return [(where, code) for where, code in blocks if "chunked_loss(" in code]


EXAMPLES = documented_examples()


def test_every_documented_example_is_run():
    assert [where for where, _ in EXAMPLES] == ["docs/keras_hub.md", "chunked_loss.__doc__"]


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_documented_example_runs_as_written(where, code, monkeypatch):
    import keras_hub
    import tensorflow as tf

    import recompute
    import recompute.keras_hub as hub
    from accum import AccumOptimizer

    models = []

    def from_preset(path, **kwargs):
        models.append(tiny("gemma"))
        return models[-1]

    monkeypatch.setattr(keras_hub.models.GemmaCausalLM, "from_preset", from_preset)
    x, y, weight = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weight)).batch(N)
    exec(compile(code, f"<{where}>", "exec"), dict(
        keras=keras, keras_hub=keras_hub, recompute=recompute, AccumOptimizer=AccumOptimizer,
        path="a preset", dataset=dataset))
    (lm,) = models
    assert hub.is_chunked(lm) and int(lm.optimizer.micro_steps.numpy()) == 1, where
