"""recompute_grad on Keras 3: side effects (moving statistics, add_loss) happen once."""

import keras
import numpy as np
import pytest

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close, to_numpy
from tests.helpers.k3_blocks import CALLS, inputs
from tests.helpers.recompute_runs import check_add_loss_applied_once, loss_and_gradients


class BNBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6)
        self.bn = keras.layers.BatchNormalization(momentum=0.5)

    @recompute_grad
    def call(self, x, training=None):
        CALLS["n"] += 1
        return keras.activations.relu(self.bn(self.dense(x), training=training))


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_statistics_updated_once(compile_mode, training):
    def make():
        keras.utils.set_random_seed(3)
        inp = keras.Input((5,))
        bn_block = BNBlock()
        out = keras.layers.Dense(1)(bn_block(bn_block(keras.layers.Dense(6)(inp))[:, :6]))
        return keras.Model(inp, out)

    x = inputs((6, 5))
    results = []
    for on in (False, True):
        model = make()
        step = loss_and_gradients(model, compile_mode, training=training)
        with recompute.recompute_scope(on):
            for _ in range(3):
                loss, grads = step(x)
        results.append(([float(loss)] + to_numpy(grads), [np.asarray(v) for v in model.non_trainable_variables]))
    assert_all_close(results[0][0], results[1][0])
    assert_all_close(results[0][1], results[1][1], rtol=1e-6)
    # Guard: the statistics did move (training) or stayed (inference).
    moving_mean = results[0][1][0]
    assert np.any(moving_mean != 0) == training


def test_add_loss_applied_once():
    check_add_loss_applied_once(keras, inputs((3, 4)))
