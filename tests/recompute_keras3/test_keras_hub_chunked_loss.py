"""`recompute.keras_hub.chunked_loss` on Keras's TensorFlow backend: loss, gradients, fit with
LoRA and AccumOptimizer, evaluate and accuracy equal the full-logit model's; predict
unchanged; compile again drops it; refusals (the tests: tests.helpers.keras_hub_chunked_checks);
and, TensorFlow's own, the head compiled by XLA (`jit_compile=True`)."""

import pytest

pytest.importorskip("keras_hub")

from tests.helpers.keras_hub_chunked_checks import *  # noqa: E402,F403 (the tests, collected here)


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_xla_compiled_fit_equals_full_logits(family):
    """Under XLA (`compile(jit_compile=True)`, Keras's default on a GPU) the head subtracts
    the one-hot targets with a scatter (XLA has no `InplaceSub`, which it uses elsewhere):
    two SGD steps give the full-logit model's losses and weights."""
    import keras

    import recompute.keras_hub as hub
    from tests.helpers.keras_hub_chunked_checks import data, tiny
    from tests.helpers.numerics import assert_all_close

    x, y, weight = data()
    runs = []
    for chunked in (False, True):
        lm = tiny(family)
        lm.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=True)
        if chunked:
            hub.chunked_loss(lm, chunk_tokens=5)
        losses = [lm.train_on_batch(x, y, weight, return_dict=True)["loss"] for _ in range(2)]
        runs.append([keras.ops.convert_to_numpy(v) for v in [*losses, *lm.trainable_variables]])
    assert_all_close(runs[0], runs[1], ["loss 1", "loss 2"] + [v.path for v in lm.trainable_variables])
