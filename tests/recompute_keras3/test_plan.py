"""`recompute.plan`: the line fit, the divisor chosen and checked, the next divisor refused,
training with the plan's settings equal to one big batch, and the error messages.

The model is tiny (3 Transformer-like blocks, seq 64, width 64), its budget 24 MiB of
TensorFlow's CPU allocator (`memory="allocator"`, which misses tensors of a few KiB: the
micro-batches measured are 4 and 8, not 2 and 4; the RSS meter is tested where its peak can be
reset), so that the search takes half a minute.
"""

import dataclasses
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import planner, recompute_grad

ROOT = Path(__file__).resolve().parents[2]
SEQ, WIDTH, EFFECTIVE = 64, 64, 32


def make_block(policy):
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = keras.layers.MultiHeadAttention(4, WIDTH // 4)
            self.d1 = keras.layers.Dense(WIDTH * 4, activation="gelu")
            self.d2 = keras.layers.Dense(WIDTH)
            self.ln1 = keras.layers.LayerNormalization()
            self.ln2 = keras.layers.LayerNormalization()

        def call(self, x, training=None):
            x = self.ln1(x + self.mha(x, x, training=training))
            return self.ln2(x + self.d2(self.d1(x)))

    if policy is not None:
        Block.call = recompute_grad(policy=policy)(Block.call)
    return Block


def build_model(policy):
    keras.utils.set_random_seed(0)
    block = make_block(policy)
    inp = keras.Input((SEQ, WIDTH))
    h = inp
    for _ in range(3):
        h = block()(h)
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    # SGD: Adam would turn the float noise of a gradient that is zero in exact arithmetic
    # (the attention key bias: softmax ignores it) into steps of the learning rate
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def data(n, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, SEQ, WIDTH).astype("float32"), rng.randn(n, 1).astype("float32")


def allocator_stats():
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        return True
    except ValueError:
        return False


needs_allocator = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")) or not allocator_stats(),
    reason="TensorFlow's CPU allocator keeps no statistics here (TF_ENABLE_ONEDNN_OPTS=1)")


# --------------------------------------------------------------------------
# The arithmetic.


def test_divisors_line_and_prediction():
    assert planner.divisors(64) == [1, 2, 4, 8, 16, 32, 64]
    assert planner.divisors(12) == [1, 2, 3, 4, 6, 12]
    a, s = planner.fit_line([(2, 100.0 + 2 * 30), (4, 100.0 + 4 * 30)])
    assert (a, s) == pytest.approx((100.0, 30.0))
    # 100 + 30 b <= 400: b <= 10, the largest divisor of 64 is 8, of 12 is 6
    assert planner.predict(a, s, 64, 400.0) == 8
    assert planner.predict(a, s, 12, 400.0) == 6
    assert planner.predict(a, s, 64, 120.0) is None
    assert planner.predict(a, -1.0, 64, 120.0) == 64  # a slope of noise: everything fits


class _FakePlanner(planner._Planner):
    """The check of `_Planner` against peaks given by a function of the batch."""

    def __init__(self, peak, effective_batch, budget):
        super().__init__(None, None, None, effective_batch, budget, (2, 4), (None,), "auto",
                         False)
        self.peak_of = peak

    def step(self, model, policy, batch):
        return self.peak_of(batch), 0.1 * batch


@pytest.mark.parametrize("predicted", [1, 4, 8, 16, 64])
def test_check_steps_to_the_largest_measured_divisor_whatever_the_prediction(predicted):
    # true peaks: 100 + 30 b with a bump: batch 8 fits (340), 16 does not (580 > 400)
    fake = _FakePlanner(lambda b: 100 + 30 * b, 64, 400.0)
    cand = planner.Candidate(None, predicted_batch=predicted)
    fake.check(cand, model=None)
    assert (cand.micro_batch, cand.refused_batch) == (8, 16)
    assert cand.measured_peak <= 400 < cand.points[16][0]


def test_check_when_nothing_fits_or_everything_fits():
    fake = _FakePlanner(lambda b: 500 + b, 8, 400.0)
    cand = planner.Candidate(None, predicted_batch=None)
    fake.check(cand, model=None)
    assert not cand.fits and cand.refused_batch == 1
    fake = _FakePlanner(lambda b: 10 + b, 8, 400.0)
    cand = planner.Candidate(None, predicted_batch=2)
    fake.check(cand, model=None)
    assert cand.micro_batch == 8 and cand.refused_batch is None


def test_a_policy_that_recomputes_more_is_checked_above_the_micro_batch_of_one_that_does_not():
    """At or below the micro-batch a policy that recomputes less fits, a policy cannot be
    faster per sample: its check starts at the divisor above (whatever its line predicts),
    and keeps no micro-batch if that does not fit."""
    none = planner.Candidate(None, micro_batch=8, points={8: (340, 0.8)})
    fake = _FakePlanner(lambda b: 100 + 20 * b, 64, 400.0)  # "full": 8 fits, 16 does not
    fake.done = [none]
    full = planner.Candidate("full", predicted_batch=4)
    assert fake.dominant(full) is none
    assert fake.dominant(planner.Candidate(None, predicted_batch=4)) is None  # not more
    fake.check(full, model=None, floor=8)
    assert not full.fits and full.refused_batch == 16 and sorted(full.points) == [16]
    fake = _FakePlanner(lambda b: 100 + 5 * b, 64, 400.0)  # "full": 32 fits, 64 does not
    full = planner.Candidate("full", predicted_batch=4)
    fake.check(full, model=None, floor=8)
    assert (full.micro_batch, full.refused_batch) == (32, 64)
    assert sorted(full.points) == [16, 32, 64]


def test_a_candidate_estimated_slower_than_one_measured_is_not_checked():
    """The time line of the two small steps (seconds = c + t * batch) estimates a candidate's
    time per sample at its predicted micro-batch; over 1.1 x the fastest measured so far, it
    is not checked (it cannot win); under, it is."""
    none = planner.Candidate(None, micro_batch=16, points={16: (340, 4.8)}, checked=True)
    fake = _FakePlanner(lambda b: 100 + 20 * b, 64, 400.0)
    fake.done = [none]  # 0.3 s per sample measured at 16
    full = planner.Candidate("full", points={2: (140, 0.9), 4: (180, 1.7)})
    full.time_intercept, full.time_slope = planner.fit_line([(2, 0.9), (4, 1.7)])
    full.estimated_seconds_per_sample = full.estimate(32)  # (0.1 + 0.4 * 32) / 32
    assert full.estimated_seconds_per_sample == pytest.approx(0.403125)
    assert fake.cannot_win(full, 32) == (
        "not checked: its estimate at micro-batch 32, 0.4031 s/sample, is over 1.1 x policy "
        "None's measured 0.3000 at 16")
    attention = planner.Candidate("attention", estimated_seconds_per_sample=0.32)
    assert fake.cannot_win(attention, 32) is None  # within the margin: checked
    assert _FakePlanner(lambda b: b, 64, 400.0).cannot_win(full, 32) is None  # none measured
    assert planner._seconds_cell(full) == "~0.4031"  # the table shows an estimate so
    fake.every_policy = True  # plan(..., every_policy=True): every candidate is checked
    assert fake.cannot_win(full, 32) is None


def test_a_policy_bounded_by_a_lighter_ones_time_is_not_built():
    """Above the micro-batch of a policy that recomputes less, a policy does at least its work
    per sample: that policy's measured time per sample, less its time line's intercept spread
    over more samples, bounds it. Within 1.1 x of the bound, the fastest measured cannot be
    beaten by more: the policy is not even built."""
    none = planner.Candidate(None, micro_batch=16, points={16: (340, 4.8)}, checked=True,
                             time_intercept=0.2, time_slope=0.28)
    fake = _FakePlanner(lambda b: b, 64, 400.0)
    fake.done = [none]  # 0.3 s/sample at 16; at 64 at least 0.3 - 0.2 * (1/16 - 1/64)
    assert fake.bounded("full") == (
        "not measured: above micro-batch 16, policy None's time per sample stays above 0.2906 "
        "s (measured 0.3000, less its time line's intercept spread over more samples), so a "
        "policy that recomputes more cannot beat the fastest measured, policy None's 0.3000, "
        "by more than 1.1 x")
    none.time_intercept = 4.0  # much to spread above 16: at least 0.3 - 4 * 3/64 = 0.1125
    assert fake.bounded("full") is None
    assert fake.bounded(None) is None  # not lighter than itself
    none.time_intercept = 0.2
    assert fake.bounded("full") is not None
    fake.every_policy = True  # plan(..., every_policy=True): every policy is built
    assert fake.bounded("full") is None
    fake.every_policy = False
    none.time_intercept = 4.0
    # once checked, the line runs through the kept and the refused micro-batches
    none.points[32], none.refused_batch = (600, 8.8), 32
    fake.retime(none)
    assert (none.time_intercept, none.time_slope) == pytest.approx((0.8, 0.25))


# --------------------------------------------------------------------------
# A real plan of the tiny model.


@pytest.fixture(scope="module")
def tiny_plan():
    x, y = data(4)
    # None keeps about 1.7 MiB per sample here, "full" about half of that
    return planner.plan(build_model, x, y, effective_batch=EFFECTIVE, budget_gib=24 / 1024,
                        policies=(None, "full"), batches=(4, 8), memory="allocator",
                        every_policy=True)  # each candidate measured, whatever the times


@pytest.mark.slow  # the plan: about 30 s on 2 cores
@needs_allocator
def test_plan_fits_and_the_next_divisor_is_refused(tiny_plan):
    p = tiny_plan
    assert p.micro_batch * p.steps_per_update == EFFECTIVE
    assert p.measured_peak <= p.budget
    refused = 0
    for c in p.candidates:
        assert c.intercept is not None and c.slope > 0, c
        if not c.fits:
            continue
        assert c.measured_peak <= p.budget
        assert EFFECTIVE % c.micro_batch == 0
        if c.refused_batch is not None:
            refused += 1
            assert c.refused_batch == planner.divisors(EFFECTIVE)[
                planner.divisors(EFFECTIVE).index(c.micro_batch) + 1]
            assert c.points[c.refused_batch][0] > p.budget
        else:
            assert c.micro_batch == EFFECTIVE
    assert refused >= 1, p.table()  # the budget binds somewhere
    fastest = min((c for c in p.candidates if c.fits), key=lambda c: c.seconds_per_sample)
    assert p.policy == fastest.policy
    # the table and the JSON carry the candidates
    assert "| None |" in p.table() and "| 'full' |" in p.table()
    record = __import__("json").loads(p.to_json())
    assert record["micro_batch"] == p.micro_batch and len(record["candidates"]) == 2


def _train(model, x, y, fit):
    fit(model, x, y)
    return [np.array(w) for w in model.get_weights()]


@pytest.mark.slow
@needs_allocator
def test_training_with_the_plan_equals_one_big_batch(tiny_plan):
    x, y = data(3 * EFFECTIVE, seed=1)  # 3 updates
    big = _train(build_model(None), x, y,
                 lambda m, x, y: m.fit(x, y, batch_size=EFFECTIVE, shuffle=False, verbose=0))
    # the plan chosen, and each candidate's own micro-batch (one with k > 1 at least)
    plans = [tiny_plan] + [
        dataclasses.replace(tiny_plan, policy=c.policy, micro_batch=c.micro_batch,
                            steps_per_update=EFFECTIVE // c.micro_batch)
        for c in tiny_plan.candidates if c.fits]
    assert any(p.steps_per_update > 1 for p in plans)
    for p in plans:
        model = p.build(build_model)
        planned = _train(model, x, y, lambda m, x, y: p.fit(m, x, y, shuffle=False, verbose=0))
        # relative to the largest weight: the attention key bias gets a gradient that is zero
        # in exact arithmetic, its values are float noise (1e-10) in both runs
        scale = max(np.abs(b).max() for b in big)
        for a, b in zip(planned, big):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def test_rss_meter_resets_its_peak():
    try:
        meter = planner._Rss()
    except RuntimeError:
        pytest.skip("/proc/self/clear_refs cannot be written here")
    meter.reset()
    before = meter.peak()
    block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
    assert meter.peak() >= before + 60 * 1024 * 1024
    del block
    meter.reset()
    assert meter.peak() < before + 32 * 1024 * 1024


# --------------------------------------------------------------------------
# One function, one module: `recompute.plan` stays the function.


def test_plan_is_the_function_after_the_module_is_imported():
    import importlib

    importlib.import_module("recompute.planner")
    from recompute import plan

    assert callable(recompute.plan) and plan is recompute.plan is planner.plan
    assert "plan" in recompute.__all__ and "Plan" in recompute.__all__


# --------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("value", [2.5, 0, -4, "64", True, None])
def test_effective_batch_must_be_an_integer(value):
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            f"`effective_batch` must be an integer >= 1. Received: effective_batch={value!r}")):
        recompute.plan(build_model, x, y, value, budget_gib=1)


def test_effective_batch_below_the_smallest_micro_batch():
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            "`effective_batch` must be at least the smallest micro-batch measured "
            "(`batches`=(2, 4))")):
        recompute.plan(build_model, x, y, 1, budget_gib=1)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="a GPU gives a default")
def test_budget_is_required_on_a_cpu():
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            "`budget_gib` is required on a CPU (the default is the accelerator's memory, and "
            "there is none). Received: budget_gib=None")):
        recompute.plan(build_model, x, y, 8)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "4"])
def test_budget_must_be_positive(value):
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape("`budget_gib` must be a positive number")):
        recompute.plan(build_model, x, y, 8, budget_gib=value)


def test_budget_below_the_weights():
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            "`budget_gib` must be above the model's weights alone (0.001 GiB): no micro-batch "
            "can train within it. Received: budget_gib=1e-06")):
        recompute.plan(build_model, x, y, 8, budget_gib=1e-6, verbose=False)


def build_dense(policy):
    """A model of one Dense layer on 4 features: its plan's first candidate is measured in a
    few seconds (the policy changes nothing here)."""
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def test_a_model_that_cannot_be_built_twice():
    rng = np.random.RandomState(0)
    x, y = rng.randn(2, 4).astype("float32"), rng.randn(2, 1).astype("float32")
    calls = []

    def once(policy):
        if calls:
            raise ValueError("layer name 'encoder' is already used")
        calls.append(policy)
        return build_dense(policy)

    with pytest.raises(ValueError, match=re.escape(
            "`build_model('full')` failed on call 2: the planner builds a fresh model for every "
            "candidate policy, so `build_model` must be callable more than once. Received: "
            "ValueError: layer name 'encoder' is already used")):
        recompute.plan(once, x, y, 4, budget_gib=1, policies=(None, "full"), batches=(1, 2),
                       verbose=False)

    model = build_dense(None)
    with pytest.raises(ValueError, match=re.escape(
            "`build_model` must build a new model at every call (the planner builds one per "
            "candidate policy). Received: the same model object twice")):
        recompute.plan(lambda policy: model, x, y, 4, budget_gib=1, policies=(None, "full"),
                       batches=(1, 2), verbose=False)


def test_a_model_that_is_not_compiled():
    x, y = data(2)

    def uncompiled(policy):
        inp = keras.Input((SEQ, WIDTH))
        return keras.Model(inp, keras.layers.Dense(1)(inp))

    with pytest.raises(ValueError, match=re.escape(
            "`build_model(None)` must return a compiled Keras model")):
        recompute.plan(uncompiled, x, y, 4, budget_gib=1, verbose=False)


def test_memory_must_be_known():
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            "`memory` must be one of 'auto', 'rss', 'allocator', 'plan'. "
            "Received: memory='gpu'")):
        recompute.plan(build_model, x, y, 4, budget_gib=1, memory="gpu", verbose=False)


def test_target_and_xla_plan_need_keras_on_jax():
    """`target` (a GPU XLA plans for) and memory="plan" read XLA's plan of Keras's JAX step:
    on TensorFlow, one clear error each, before anything is measured."""
    x, y = data(2)
    with pytest.raises(ValueError, match=re.escape(
            "`target` plans for a GPU this machine does not have with XLA's plan, on Keras's "
            "JAX backend")):
        recompute.plan(build_model, x, y, 4, budget_gib=1, target="h100", verbose=False)
    with pytest.raises(ValueError, match=re.escape(
            "`memory='plan'` reads XLA's plan of Keras's JAX training step: the model runs on "
            "Keras's tensorflow backend. Received: memory='plan'")):
        recompute.plan(build_model, x, y, 4, budget_gib=1, memory="plan", verbose=False)


def test_check_interpolates_when_the_line_is_far_off():
    """XLA's plan of a small batch can be held up by weight-sized buffers: the line then
    predicts the whole effective batch. Once 256 is refused, the check measures where the
    line through the bracket's ends crosses the budget instead of stepping down one divisor
    at a time: 256 refused, then 8 (fits), 16 (refused) -- not 128, 64, 32, 16, 8."""
    fake = _FakePlanner(lambda b: max(300, 100 + 30 * b), 256, 400.0)
    cand = planner.Candidate(None, predicted_batch=256)
    cand.points = {2: (300, 0.2), 4: (300, 0.4)}  # the line's points count
    fake.check(cand, model=None)
    assert (cand.micro_batch, cand.refused_batch) == (8, 16)
    assert sorted(cand.points) == [2, 4, 8, 16, 256]


# --------------------------------------------------------------------------
# The documented example.


def _block_after(path, marker):
    text = path.read_text()
    rest = text[text.index(marker):]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start:rest.index("```", start)]


def test_readme_shows_the_example_of_the_docs_page():
    example = _block_after(ROOT / "docs" / "plan.md", "<!-- plan-example")
    readme = _block_after(ROOT / "README.md", "<!-- plan-readme -->")
    assert readme.strip() and readme in example


@pytest.mark.slow  # the plan of docs/plan.md: about 30 s on 2 cores
@needs_allocator
def test_docs_example_runs(capsys, tmp_path):
    import runpy

    # a real file: AutoGraph reads the source of the functions it converts
    script = tmp_path / "plan_example.py"
    script.write_text(_block_after(ROOT / "docs" / "plan.md", "<!-- plan-example"))
    namespace = runpy.run_path(str(script))
    plan = namespace["plan"]
    assert plan.micro_batch * plan.steps_per_update == 32
    assert plan.measured_peak <= plan.budget
    assert "Chosen: policy" in capsys.readouterr().out
