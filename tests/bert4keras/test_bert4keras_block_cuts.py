"""recompute.bert4keras: under "block" a block's batch recomputed in cuts (`recompute.batch_cut`)
on tf_keras equals whole batches and RECOMPUTE=0 (own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1).

A file of its own, apart from `test_bert4keras_patch.py`: under `--dist loadfile` a file runs
on one worker, and these comparisons (two traced steps each, 30 to 40 s) balance the suite's
two workers better on their own."""

import os

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import recompute  # noqa: E402
import recompute.bert4keras as rb  # noqa: E402

rb.patch()

import tensorflow as tf  # noqa: E402

from tests.helpers import tiny_bert  # noqa: E402
from tests.helpers.numerics import assert_all_close, to_numpy  # noqa: E402
from tests.helpers.recompute_runs import count_cut_recomputations  # noqa: E402


def _five_samples():
    """A batch of 5 (2 whole cuts of 2 and a rest of 1 under `batch_cut(2)`), padded."""
    rng = np.random.RandomState(0)
    token_ids = rng.randint(1, 100, size=(5, 12))
    token_ids[1, 7:] = 0
    token_ids[3, 4:] = 0
    return token_ids, np.zeros_like(token_ids), np.array([0, 1, 1, 0, 1])


def _steps_cut(config_path, on, cut, mode):
    """Two training steps' losses and gradients of `tiny_bert.classifier(config_path)` on
    `_five_samples`, recomputation `on`, `recompute.batch_cut(cut)`, `mode` "eager", "function" or
    "unknown-shapes" (a function traced with the batch and sequence unknown: the cuts are
    counted when it runs, `recompute.batch_cut(None)`'s rule from the sequence length)."""
    token_ids, segment_ids, labels = _five_samples()
    model = tiny_bert.classifier(config_path)
    tf.random.set_seed(1)  # the legacy RNG's seeds: the same in every run
    step = tiny_bert.loss_and_gradients(model, labels)
    spec = [tf.TensorSpec([None, None], tf.int64)] * 2
    run = step if mode == "eager" else tf.function(step) if mode == "function" \
        else tf.function(step, input_signature=spec)
    with recompute.recompute_scope(on), recompute.batch_cut(cut):
        # the second step draws new masks
        return [to_numpy(run(tf.constant(token_ids), tf.constant(segment_ids)))
                for _ in range(2)]


@pytest.fixture(params=["replayable", "legacy"])
def rng_kind(request):
    """tf_keras's replayable RNG (masks equal RECOMPUTE=0's) or its default, the legacy
    one (masks replayed from one seed per block)."""
    if request.param == "replayable":
        tf.keras.backend.experimental.enable_tf_random_generator()
    yield request.param
    tf.keras.backend.experimental.disable_tf_random_generator()


# "block_keep_ffn" cuts the same recomputation (the block's): its case is the hardest one.
@pytest.mark.slow(seconds=25)  # two steps of whole batches and of cuts, each traced
@pytest.mark.parametrize("policy_name, mode", [
    ("block", "eager"), ("block", "function"), ("block", "unknown-shapes"),
    ("block_keep_ffn", "unknown-shapes")])
def test_block_cuts_match_whole_batches(dropout_config_path, rng_kind, policy_name, mode,
                                        monkeypatch):
    """Under "block" (and "block_keep_ffn") a block whose batch is more than one cut
    runs its recomputation by cuts (`recompute.batch_cut`): 5 samples by 2 is two whole
    cuts and a rest; with the shapes unknown when traced, the rule's cut at seq 12 (the
    whole batch, one cut) and cuts of 2 counted when the step runs. Dropout on, padding:
    each step's loss and every gradient equal the whole batch's recomputation (the same
    masks, from the batch's numbers), and with the replayable RNG RECOMPUTE=0's, the
    second step included (the generators advanced as one draw of the batch advances
    them). Both blocks ran by cuts, in both steps."""
    rb.patch(policy=policy_name)
    try:
        cutting = count_cut_recomputations(monkeypatch)
        whole = _steps_cut(dropout_config_path, True, 0, mode)
        assert cutting["n"] == 0
        runs = [_steps_cut(dropout_config_path, True, cut, mode)
                for cut in ([2, None] if mode == "unknown-shapes" else [2])]
        # traced once in a function
        assert cutting["n"] == len(runs) * 2 * (2 if mode == "eager" else 1)
        reference = _steps_cut(dropout_config_path, False, 0, mode) \
            if rng_kind == "replayable" else None
    finally:
        rb.patch()
    for cut in runs:
        for step in range(2):
            assert_all_close(whole[step], cut[step])
            if reference is not None:
                assert_all_close(reference[step], cut[step])
        assert not np.allclose(cut[0][0], cut[1][0])  # other masks in the second step


@pytest.mark.slow(seconds=40)  # two tiny fits, each traced
def test_block_cuts_fit_matches(dropout_config_path, replayable_rng, monkeypatch):
    """`fit` (batches of 5, a last one of 3; cuts of 2) with "block" and the replayable
    RNG: tf_keras traces its step with the batch unknown, and the blocks run by cuts
    counted when it runs; the weights after 2 epochs equal RECOMPUTE=0's."""
    cutting = count_cut_recomputations(monkeypatch)
    token_ids, segment_ids, labels = _five_samples()
    x = [np.tile(token_ids, (3, 1))[:13], np.tile(segment_ids, (3, 1))[:13]]
    y = np.tile(labels, 3)[:13]
    rb.patch(policy="block")
    weights = []
    try:
        for on in (False, True):
            model = tiny_bert.classifier(dropout_config_path)
            model.compile(tf.keras.optimizers.Adam(1e-3),
                          tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            with recompute.recompute_scope(on), recompute.batch_cut(2):
                model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
            weights.append([np.asarray(w) for w in model.weights])
    finally:
        rb.patch()
    assert cutting["n"] and cutting["n"] % 2 == 0  # both blocks, in each trace of the step
    assert_all_close(weights[0], weights[1])
