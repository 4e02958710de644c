"""`python -m recompute.planner --preset minilm` under TF_USE_LEGACY_KERAS=1 plans bert4keras's
converted MiniLM checkpoint: the folder it resolves holds the checkpoint, and the builder it
makes builds a tf_keras model of it once per policy (the whole plan takes minutes: run by hand,
docs/plan.md)."""

import os

import numpy as np
import pytest


def test_minilm_resolves_to_the_bert4keras_checkpoint_folder():
    from recompute import planner

    folder = planner._preset_folder("minilm")
    assert os.path.isfile(os.path.join(folder, "bert_config.json"))
    assert any(name.startswith("bert_model.ckpt") for name in os.listdir(folder))


def test_builder_builds_a_compiled_model_per_policy():
    from recompute import planner

    planner.np = np  # `main` imports numpy for the builders
    build_model, inputs, vocab = planner._bert4keras_builder(
        planner._preset_folder("minilm"), seq=16, learning_rate=1e-4)
    import recompute.bert4keras

    try:
        first, second = build_model(None), build_model("full")
        assert first is not second and first.optimizer is not None
        ids = np.ones((2, 16), "int32")
        assert first.predict(inputs(ids), verbose=0).shape == (2, 2)
    finally:
        recompute.bert4keras.unpatch()  # the builder patches bert4keras, as the plan does


@pytest.mark.slow(seconds=80)  # three MiniLM builds, 3 updates of 8 at seq 16
def test_training_with_a_plan_equals_one_big_batch(tmp_path):
    """The plan's settings on the real MiniLM checkpoint (bert4keras, dropout off): policy
    "full" (`patch(policy="block")`), micro-batch 2 x 4 steps (AccumOptimizer) train the same
    weights as batch 8 with no recomputation, to 1e-5 of the largest weight after 3 updates.
    SGD, not the builder's Adam: Adam turns the float noise of gradients that are zero in
    exact arithmetic (the attention key bias) into steps of the learning rate."""
    import json

    import tf_keras

    import recompute.bert4keras
    from recompute import planner

    folder = planner._preset_folder("minilm")
    with open(os.path.join(folder, "bert_config.json")) as f:
        config = json.load(f)
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with open(tmp_path / "bert_config.json", "w") as f:
        json.dump(config, f)
    for name in os.listdir(folder):
        if name.startswith("bert_model.ckpt") or name == "checkpoint":
            os.symlink(os.path.join(folder, name), tmp_path / name)
    planner.np = np
    seq, effective = 16, 8
    build_adam, inputs, vocab = planner._bert4keras_builder(str(tmp_path), seq, 1e-4)

    def build_model(policy):
        model = build_adam(policy)
        model.compile(optimizer=tf_keras.optimizers.SGD(0.05),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.RandomState(0)
    ids = rng.randint(1000, vocab, size=(3 * effective, seq)).astype("int32")
    labels = rng.randint(0, 2, size=(3 * effective,)).astype("int32")
    try:
        big = build_model(None)
        big.fit(inputs(ids), labels, batch_size=effective, shuffle=False, verbose=0)
        plan = planner.Plan(policy="full", micro_batch=2, steps_per_update=4,
                            effective_batch=effective, predicted_peak=0.0, measured_peak=0.0,
                            seconds_per_sample=0.0, budget=0.0, memory="-", candidates=[])
        model = plan.build(build_model)
        plan.fit(model, inputs(ids), labels, shuffle=False, verbose=0)
    finally:
        recompute.bert4keras.unpatch()
    expected = big.get_weights()
    scale = max(np.abs(w).max() for w in expected)
    moved = max(np.abs(a - b).max() for a, b in zip(big.get_weights(), build_model(None).get_weights()))
    assert moved > 1e-4 * scale  # 3 updates changed the weights
    for a, b in zip(model.get_weights(), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)
