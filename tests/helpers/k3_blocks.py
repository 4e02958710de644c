"""Keras 3 blocks, models and runs shared by the recompute_keras3 suite (with and without recomputation)."""

import keras
import numpy as np
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import to_numpy

CALLS = {"n": 0}


class DropoutAttentionBlock(keras.layers.Layer):
    """Self-attention with dropout (the case the blocked core serves in float32; both
    Keras 3 suites, TensorFlow and JAX)."""

    def __init__(self, policy, **kwargs):
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)
        self.call = recompute_grad(self.call, policy=policy)

    def call(self, x, training=None):
        return self.mha(x, x, training=training)


class Block(keras.layers.Layer):
    """Dense-GELU-Dropout-Dense + residual + LayerNorm, plus an unseeded keras.random op."""

    def __init__(self, units, rate=0.3, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(units * 2, activation="gelu")
        self.drop = keras.layers.Dropout(rate)
        self.d2 = keras.layers.Dense(units)
        self.ln = keras.layers.LayerNormalization()

    @recompute_grad
    def call(self, x, training=None):
        CALLS["n"] += 1
        h = self.d2(self.drop(self.d1(x)))
        if training:
            h = keras.random.dropout(h, 0.1)  # the global SeedGenerator
        return self.ln(x + h)


class PlainBlock(Block):
    """The same block without the decorator (for "no extra ops" checks)."""

    def call(self, x, training=None):
        return Block.call.__recompute_grad_wrapped__(self, x, training=training)


def build_model(block=Block, depth=3, units=8, seed=0, head_dtype=None):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((units,))
    h = inp
    for _ in range(depth):
        h = block(units)(h)
    out = keras.layers.Dense(1, dtype=head_dtype)(h)
    return keras.Model(inp, out)


def inputs(shape=(4, 8), seed=(1, 2)):
    return tf.random.stateless_normal(shape, seed=seed)


def train_grads(model, x, compile_mode, steps=2):
    """Runs `steps` gradient computations; returns loss and grads of the last one."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return loss, tape.gradient(loss, [x] + model.trainable_variables)

    if compile_mode == "function":
        step = tf.function(step)
    elif compile_mode == "jit":
        step = tf.function(step, jit_compile=True)
    for _ in range(steps):
        loss, grads = step(x)
    return float(loss), to_numpy(grads)


def run_both(make_model, x, compile_mode, steps=2):
    results = {}
    for on in (False, True):
        model = make_model()
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            loss, grads = train_grads(model, x, compile_mode, steps)
        state = [np.asarray(v) for v in model.non_trainable_variables]
        results[on] = (loss, grads, CALLS["n"], state, model)
    return results


def _graph_op_types(model, x, training):
    @tf.function
    def fwd(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=training)
        return y

    return sorted(op.type for op in fwd.get_concrete_function(x).graph.get_operations())
