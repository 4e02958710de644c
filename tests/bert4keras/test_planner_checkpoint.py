"""`python -m recompute.planner --preset minilm` under TF_USE_LEGACY_KERAS=1 plans bert4keras's
converted MiniLM checkpoint: the folder it resolves holds the checkpoint, and the builder it
makes builds a tf_keras model of it once per policy (the whole plan takes minutes: run by hand,
docs/plan.md)."""

import os

import numpy as np


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
