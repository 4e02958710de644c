"""LoRA + `recompute.keras_hub.patch()` + `AccumOptimizer` on a keras-hub causal LM (issue 27),
run on Keras's TensorFlow backend (tests/recompute_keras3/test_keras_hub_lora.py) and on JAX
(tests/recompute_jax/test_keras_hub_lora_jax.py), which import the `test_*` functions
(`__all__`).

The model: a tiny `GemmaCausalLM` (hidden 16, 2 blocks, dropout 0.1, no preprocessor) after
`backbone.enable_lora(2)`, its `lora_kernel_b` set non-zero (at zero, `lora_kernel_a` has
no gradient and would be compared as zeros); token ids with padded tails, the padding mask
as sample weights.

- `test_lora_gradients_equal_unpatched`: a custom step (TensorFlow: `GradientTape`; JAX:
  `stateless_call` under `jax.value_and_grad`): patched, RECOMPUTE on, under both policies,
  the loss and the gradient of every LoRA weight equal RECOMPUTE=0 unpatched (<= 1e-5), none
  missing; the recomputation counted.
- `test_lora_accumulation_equals_big_batch`: `fit` with `AccumOptimizer(SGD | Adam, 2)` at
  batch 2 equals the inner optimizer at batch 4 (dropout 0: micro-batches draw other masks)
  on every LoRA weight after 3 updates, RECOMPUTE on; the frozen weights bit-identical.
- `test_lora_save_and_resume_in_a_fresh_process` (dropout 0: Keras saves no seed state):
  trained with `train_on_batch` to the
  middle of a window, saved; a fresh process (this module as `python -m ... job.json`)
  resumes and ends bit for bit (CPU) like the uninterrupted run. Keras saves a LoRA layer
  with its factors merged into the kernel (`EinsumDense.save_own_variables`), and loading
  zeroes the factors; keras-hub's config has no LoRA. So a `.weights.h5` alone does not
  resume a LoRA fine-tune (checked here, so that a Keras change shows), and the `.keras`
  file round-trips the trained model for inference (the same logits), not its training
  state (its LoRA factors and optimizer). The exact resume: the `.weights.h5` (optimizer
  state, window, seeds), the base weights the fine-tune started from (its preset) and
  `backbone.save_lora_weights(...)`'s `.lora.h5`, loaded in that order (`resume`).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from recompute import recompute_scope
from tests.helpers.numerics import assert_all_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V, SEQ, RANK = 40, 8, 2
K, STOP, N = 2, 3, 6  # save/resume: window k, micro-steps before the save, in all


def lora_lm(seed=0, dropout=0.1, base_path=None):
    """The tiny `GemmaCausalLM` with LoRA (rank 2) on its query and value projections, its
    `lora_kernel_b` non-zero. `base_path`: the backbone's weights are saved there first
    (the base a fine-tune starts from, as a preset holds them)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=V, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=dropout)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if base_path:
        backbone.save_weights(base_path)
    backbone.enable_lora(RANK)
    rng = np.random.default_rng(seed)
    for v in lm.trainable_variables:
        if v.path.endswith("lora_kernel_b"):
            v.assign(rng.normal(scale=0.3, size=v.shape).astype("float32"))
    return lm


def data(n=4, seed=1):
    """(x, y, sample_weight): next-token prediction on random ids with padded tails."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(SEQ // 2, SEQ + 1, n).astype(int)
    mask = np.arange(SEQ + 1)[None, :] < lengths[:, None]
    ids = np.where(mask, rng.integers(1, V, size=(n, SEQ + 1)), 0).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return x, ids[:, 1:], mask[:, 1:].astype("float32")


def _xent(logits, y, weight):
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return keras.ops.sum(loss * weight) / keras.ops.sum(weight)


def _split(lm):
    """(LoRA weights, frozen weights) of the model; the frozen ones exclude seed states."""
    lora = list(lm.trainable_variables)
    assert lora and all("lora_kernel" in v.path for v in lora), [v.path for v in lora]
    frozen = [v for v in lm.non_trainable_weights]
    assert frozen and not any("lora" in v.path for v in frozen)
    return lora, frozen


def lora_step(lm, x, y, weight, on):
    """(loss, gradient of each LoRA weight, non-trainable values after) of one custom step from
    the model's state, which it leaves as is."""
    with recompute_scope(on):
        if keras.backend.backend() == "jax":
            import jax

            trainable = [v.value for v in lm.trainable_variables]
            non_trainable = [v.value for v in lm.non_trainable_variables]

            def loss_fn(values):
                logits, state = lm.stateless_call(values, non_trainable, x, training=True)
                return _xent(logits, y, weight), state

            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            return float(loss), [np.asarray(g) for g in grads], [np.asarray(s) for s in state]
        import tensorflow as tf

        start = [v.numpy() for v in lm.variables]
        with tf.GradientTape() as tape:
            loss = _xent(lm(x, training=True), y, weight)
        grads = tape.gradient(loss, lm.trainable_variables)
        state = [np.asarray(v.numpy()) for v in lm.non_trainable_variables]
        for v, value in zip(lm.variables, start):
            v.assign(value)
        return float(loss), [None if g is None else np.asarray(g) for g in grads], state


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_lora_gradients_equal_unpatched(policy):
    """A custom step: patched, RECOMPUTE on, the loss, every LoRA gradient and the random
    state equal RECOMPUTE=0 unpatched; no LoRA gradient goes missing; blocks recomputed."""
    import recompute.keras_hub as hub
    from tests.helpers.keras_hub_decoder_checks import _recomputed_calls

    lm = lora_lm()
    lora, _ = _split(lm)
    x, y, weight = data()
    loss0, grads0, state0 = lora_step(lm, x, y, weight, on=False)
    assert all(g is not None and np.abs(g).max() > 0 for g in grads0)
    try:
        hub.patch(policy)
        assert len(hub.covered(lm)) == 2
        with _recomputed_calls() as count:
            loss1, grads1, state1 = lora_step(lm, x, y, weight, on=True)
        assert count[0] >= 2, count[0]
    finally:
        hub.unpatch()
    missing = [v.path for v, g in zip(lora, grads1) if g is None]
    assert not missing, f"LoRA weights without a gradient when recomputed: {missing}"
    assert_all_close([np.array(loss0)] + grads0, [np.array(loss1)] + grads1,
                     ["loss"] + [v.path for v in lora])
    for a, b in zip(state0, state1):
        np.testing.assert_array_equal(a, b)


def _fit(optimizer, batch_size, on):
    """The LoRA model (dropout 0) patched, trained with `fit` on 12 sequences (3 updates at
    an effective batch of 4); its (LoRA weights, frozen weights, frozen at the start)."""
    import recompute.keras_hub as hub

    lm = lora_lm(dropout=0.0)
    lora, frozen = _split(lm)
    start = [np.array(v.numpy()) for v in frozen]
    lm.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=[])
    x, y, weight = data(n=12, seed=2)
    try:
        hub.patch()
        with recompute_scope(on):
            lm.fit(x, y, sample_weight=weight, batch_size=batch_size, epochs=1, shuffle=False,
                   verbose=0)
    finally:
        hub.unpatch()
    return [np.array(v.numpy()) for v in lora], [np.array(v.numpy()) for v in frozen], start


@pytest.mark.parametrize("inner", [pytest.param("sgd", marks=pytest.mark.slow), "adam"])
def test_lora_accumulation_equals_big_batch(inner):
    """`fit`, RECOMPUTE on: `AccumOptimizer(inner, 2)` at batch 2 ends like `inner` at batch 4
    on every LoRA weight (3 updates); every frozen weight is bit-identical to its start."""
    from accum import AccumOptimizer

    def make():
        if inner == "sgd":
            return keras.optimizers.SGD(0.5, momentum=0.9)
        return keras.optimizers.Adam(0.01)

    lora4, frozen4, start4 = _fit(make(), 4, on=True)
    lora2, frozen2, start2 = _fit(AccumOptimizer(make(), K), 2, on=True)
    lora_start = [np.array(v.numpy()) for v in _split(lora_lm(dropout=0.0))[0]]
    assert all(np.abs(a - b).max() > 1e-4 for a, b in zip(lora4, lora_start))  # they trained
    assert_all_close(lora4, lora2, [f"lora[{i}]" for i in range(len(lora4))])
    for got, want in ((frozen4, start4), (frozen2, start2)):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ save and resume


def compiled(seed=0, base_path=None):
    """The LoRA model of the save/resume test, dropout 0: Keras saves no seed generator
    state (`.weights.h5`, `.keras`), so a resumed run would draw other dropout masks (any
    Keras model does)."""
    from accum import AccumOptimizer

    lm = lora_lm(seed, dropout=0.0, base_path=base_path)
    lm.compile(AccumOptimizer(keras.optimizers.Adam(0.01), K),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])
    return lm


def train(lm, start, stop):
    """Micro-steps `start..stop-1`, one `train_on_batch` of 2 sequences each, RECOMPUTE on."""
    x, y, weight = data(n=2 * N, seed=3)
    with recompute_scope(True):
        for i in range(start, stop):
            part = slice(2 * i, 2 * i + 2)
            lm.train_on_batch({k: v[part] for k, v in x.items()}, y[part], sample_weight=weight[part])


def state(lm):
    """Weights (LoRA and frozen), optimizer variables, counters (not the unsaved seed states)."""
    opt = lm.optimizer
    return ([np.asarray(v.numpy()) for v in lm.weights]
            + [np.asarray(v.numpy()) for v in opt.variables]
            + [np.array([int(opt.micro_steps.numpy()), int(opt.iterations.numpy())])])


def logits(lm):
    x, _, _ = data(n=2, seed=4)
    return np.asarray(keras.ops.convert_to_numpy(lm(x, training=False)))


def resume(paths):
    """The exact resume in a fresh process: a new LoRA model (other initial weights) and its
    optimizer, then the `.weights.h5` (optimizer state, window, seeds; its LoRA kernels are
    merged), the base weights (the frozen kernels as they were; this zeroes the factors)
    and the `.lora.h5` (the factors)."""
    lm = compiled(seed=1)
    lm.optimizer.build(lm.trainable_variables)
    lm.load_weights(paths["weights"])
    lm.backbone.load_weights(paths["base"])
    lm.backbone.load_lora_weights(paths["lora"])
    return lm


def worker(job_file):
    """The fresh process: writes `.npz` files of the resumed runs and the loaded `.keras`."""
    import accum  # noqa: F401  -- registers AccumOptimizer
    import recompute
    import recompute.keras_hub as hub

    recompute.exact_float32()
    with open(job_file) as f:
        paths = json.load(f)
    hub.patch()
    out = {}
    # `.weights.h5` alone (what Keras's saving gives a LoRA layer): factors zeroed
    lm = compiled(seed=1)
    lm.optimizer.build(lm.trainable_variables)
    lm.load_weights(paths["weights"])
    out["alone_at_load"] = state(lm)
    lm = resume(paths)
    out["resumed_at_load"] = state(lm)
    train(lm, STOP, N)
    out["resumed_finished"] = state(lm)
    loaded = keras.saving.load_model(paths["keras"], compile=False)
    out["keras_logits"] = [logits(loaded)]
    out["keras_trainable"] = [np.array(len(loaded.trainable_variables))]
    for key, arrays in out.items():
        np.savez(paths["out"] + key + ".npz", *arrays)


def _load(prefix, key):
    with np.load(prefix + key + ".npz") as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.mark.slow  # a fresh process per backend; the full suites run it
def test_lora_save_and_resume_in_a_fresh_process(tmp_path):
    """Patched, RECOMPUTE on, `AccumOptimizer(Adam, 2)`: saved after 3 micro-steps (one
    update, one pending), resumed in a fresh process from the `.weights.h5`, the base
    weights and the `.lora.h5`: bit for bit (CPU) the uninterrupted run's weights,
    optimizer state and counters after 6. The `.weights.h5` alone loads merged kernels and
    zero factors; the `.keras` file loads to the trained model's logits, without LoRA."""
    import recompute.keras_hub as hub
    from tests.helpers.numerics import accelerator
    from tests.helpers.save_resume_worker import GPU_RTOL

    paths = {name: str(tmp_path / file) for name, file in (
        ("base", "base.weights.h5"), ("weights", "lm.weights.h5"), ("lora", "lm.lora.h5"),
        ("keras", "lm.keras"), ("out", "out_"))}
    try:
        hub.patch()
        lm = compiled(seed=0, base_path=paths["base"])
        train(lm, 0, STOP)
        saved, saved_logits = state(lm), logits(lm)
        assert int(lm.optimizer.micro_steps.numpy()) == STOP and int(lm.optimizer.iterations.numpy()) == 1
        lm.save_weights(paths["weights"])
        lm.backbone.save_lora_weights(paths["lora"])
        lm.save(paths["keras"])
        train(lm, STOP, N)
        finished = state(lm)
    finally:
        hub.unpatch()
    job = tmp_path / "job.json"
    job.write_text(json.dumps(paths))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.keras_hub_lora_checks", str(job)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    exact = accelerator() is None

    def same(want, got, what):
        assert len(want) == len(got), what
        for i, (a, b) in enumerate(zip(want, got)):
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=f"{what}[{i}]")
            else:
                assert_all_close([a], [b], [f"{what}[{i}]"], rtol=GPU_RTOL)

    same(saved, _load(paths["out"], "resumed_at_load"), "at load")
    same(finished, _load(paths["out"], "resumed_finished"), "finished")
    # Keras's own saving of LoRA layers (if this fails, Keras saves the factors: simplify `resume`)
    alone = _load(paths["out"], "alone_at_load")
    lora_at = [i for i, v in enumerate(lm.weights) if "lora_kernel" in v.path]
    assert all(not np.any(alone[i]) for i in lora_at)
    assert_all_close([saved_logits], _load(paths["out"], "keras_logits"), ["`.keras` logits"])
    assert int(_load(paths["out"], "keras_trainable")[0]) != len(lora_at)


__all__ = [name for name in dir() if name.startswith("test_")]

if __name__ == "__main__":
    worker(sys.argv[1])
