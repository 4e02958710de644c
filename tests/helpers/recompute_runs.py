"""Runs and checks of the recompute_grad tests that the Keras 3 and the tf_keras suites
share although their tests differ around them (`K`: `keras` or `tf_keras`). Nothing
here imports a Keras family: the bert4keras suite uses it too.
"""

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute.engine import _core
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close, to_numpy


def count_recomputed_calls(monkeypatch):
    """Counts the calls of `_core.recomputed_call` from now on: returns {"n": count}."""
    calls = {"n": 0}
    real = _core.recomputed_call

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "recomputed_call", counting)
    return calls


def count_cut_recomputations(monkeypatch):
    """Counts the backward passes of recomputed calls that ran by cuts of their batch
    (`recompute.engine._cuts_tf`) from now on: returns {"n": count}."""
    from recompute.engine import _cuts_tf

    cutting = {"n": 0}
    real = _cuts_tf.CutRecomputation.backward

    def counting(self, *args, **kwargs):
        cutting["n"] += int(self.cutting)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_cuts_tf.CutRecomputation, "backward", counting)
    return cutting


def fit_both(K, build_model, jit_compile, weights_of, calls):
    """`fit` (SGD, 2 epochs of 4 batches) with RECOMPUTE off then on: per run, `weights_of(model)`
    and the block calls counted in `calls["n"]`; every loss is finite."""
    x = np.random.RandomState(0).randn(32, 8).astype("float32")
    y = np.random.RandomState(1).randn(32, 1).astype("float32")
    weights, counts = [], []
    for on in (False, True):
        model = build_model()
        # Plain SGD: the update is proportional to the gradient, so the weights
        # compare gradients (Adam would amplify last-bit differences of XLA fusions).
        model.compile(K.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
        calls["n"] = 0
        with recompute.recompute_scope(on):
            hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append(weights_of(model))
        counts.append(calls["n"])
        assert np.all(np.isfinite(hist.history["loss"]))
    return weights, counts


def under_outer_eager_tape(model, x):
    """The loss and gradients (input first) of `model` run in a `tf.function` under an eager tape."""
    fn = tf.function(lambda x: model(x, training=True))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(fn(x) ** 2)
    return loss, tape.gradient(loss, [x] + model.trainable_weights)


def check_add_loss_applied_once(K, x):
    """A decorated call's `add_loss` counts once, with its gradient, as without recomputation."""

    class LossBlock(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = K.layers.Dense(4)

        @recompute_grad
        def call(self, x):
            h = self.dense(x)
            self.add_loss(0.1 * tf.reduce_sum(h**2))
            return h

    results, n_losses = [], []
    for on in (False, True):
        K.utils.set_random_seed(0)
        layer = LossBlock()
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x)) + tf.add_n(layer.losses)
            g = tape.gradient(loss, [x] + layer.trainable_weights)
        n_losses.append(len(layer.losses))
        results.append([float(loss)] + to_numpy(g))
    assert n_losses == [1, 1]
    assert_all_close(results[0], results[1])


def check_variable_creation_refused(layer, x):
    """`layer` creates a variable on its second call: in the recomputation, refused."""
    with recompute.recompute_scope(True):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        with pytest.raises(recompute.VariableCreatedInRecomputationError, match="build the layer"):
            tape.gradient(y, x)


def gradient_graph(blocks, x):
    """The graph of d sum(y²)/dx through `blocks` (training), traced with recomputation on."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for b in blocks:
                y = b(y, training=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    with recompute.recompute_scope(True):
        return step.get_concrete_function(x).graph


def loss_and_gradients(model, compile_mode, training=True):
    """A step x -> (sum(model(x)²), the gradients of x and of every trainable variable),
    in a `tf.function` for compile_mode "function"."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=training) ** 2)
        return loss, tape.gradient(loss, [x] + model.trainable_variables)

    return tf.function(step) if compile_mode == "function" else step
