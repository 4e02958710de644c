"""Keras 3: a variable missing from some micro-steps (absent from the list, or a `None`
gradient) counts a zero gradient there; one untouched by a whole window is left alone.

Reference: the same inner optimizer fed the big batch, whose gradient is the mean of
the window's micro-step gradients (zero where a micro-step has none), and which does
not see a variable with no gradient in the whole window.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum import AccumOptimizer
from tests.helpers.accum_family_checks import keras3_family, new_style_only  # noqa: F401 (fixtures)
from tests.helpers.accum_missing_gradients_checks import *  # noqa: F403 (the tests, collected here)
from tests.helpers.accum_missing_gradients_checks import multitask_model, run_accum, run_minimal_sgd


@pytest.mark.parametrize("missing", ["absent", "none"])
@pytest.mark.parametrize("compile", [False, True])
def test_minimal_sgd(family, legacy, missing, compile):
    opt = run_minimal_sgd(family, legacy, missing, compile)
    for flag in opt.touched:
        assert int(flag.numpy()) == 0
    for acc in opt.accumulators:
        np.testing.assert_array_equal(acc.numpy(), 0.0)


def test_head_never_moves_regression():
    """The reported symptom: alternating two heads with k=2, head A used to stay put."""
    tasks = list("abababab")
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), 2)
    model = run_accum(keras, opt, tasks, 3, compile=True)
    initial, *_ = multitask_model(keras)
    head_a = [w for w in model.weights if "head_a" in w.path]
    head_a0 = [w for w in initial.weights if "head_a" in w.path]
    assert any(not np.allclose(w.numpy(), w0.numpy()) for w, w0 in zip(head_a, head_a0))


def test_untouched_adam_moments_do_not_decay():
    """A variable with no gradient in a whole window keeps its weights and Adam moments."""
    a = keras.Variable(np.ones(2, "float32"), name="a")
    b = keras.Variable(np.ones(2, "float32"), name="b")
    opt = AccumOptimizer(keras.optimizers.Adam(0.1), 2)
    opt.build([a, b])
    g = tf.constant([1.0, 2.0])
    for _ in range(2):
        opt.apply_gradients([(g, a), (g, b)])
    b_after, slots_after = b.numpy(), [v.numpy() for v in opt.inner_optimizer.variables if "b_" in v.path]
    for _ in range(2):
        opt.apply_gradients([(g, a)])
    np.testing.assert_array_equal(b.numpy(), b_after)
    for v, before in zip([v for v in opt.inner_optimizer.variables if "b_" in v.path], slots_after):
        np.testing.assert_array_equal(v.numpy(), before)
    assert int(opt.iterations) == 2
