"""recompute_grad on tf_keras (Keras 2): numerics against the same model without it.

Runs in its own pytest process (see README): tf_keras and Keras 3 keep separate
global state, and bert4keras-style code replaces `sys.modules["keras"]`.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as K

import recompute
from recompute.engine import _core
from recompute import recompute_grad
from tests.helpers.attention_blocks import ancestors
from tests.helpers.numerics import assert_all_close, assert_state_equal, to_numpy
from tests.helpers.recompute_runs import (
    check_add_loss_applied_once, check_variable_creation_refused, count_recomputed_calls, fit_both,
    gradient_graph, under_outer_eager_tape,
)

CALLS = {"n": 0}


@pytest.fixture(autouse=True)
def tf_random_generator():
    """Replayable RNG (tf.random.Generator) unless a test turns it off."""
    K.backend.experimental.enable_tf_random_generator()
    yield
    K.backend.experimental.enable_tf_random_generator()


class Block(K.layers.Layer):
    def __init__(self, units, rate=0.3, **kwargs):
        super().__init__(**kwargs)
        self.d1 = K.layers.Dense(units * 2, activation="gelu")
        self.drop = K.layers.Dropout(rate)
        self.d2 = K.layers.Dense(units)
        self.ln = K.layers.LayerNormalization()
        self.bn = K.layers.BatchNormalization(momentum=0.5)

    @recompute_grad
    def call(self, x, training=None):
        CALLS["n"] += 1
        h = self.d2(self.drop(self.d1(x)))  # `training` reaches Dropout via the call context
        return self.bn(self.ln(x + h))


def build_model(depth=3, units=8, seed=0):
    K.utils.set_random_seed(seed)
    inp = K.Input((units,))
    h = inp
    for _ in range(depth):
        h = Block(units)(h)
    return K.Model(inp, K.layers.Dense(1)(h))


def inputs(shape=(4, 8), seed=(1, 2)):
    return tf.random.stateless_normal(shape, seed=seed)


def state_values(model):
    """Moving statistics and every RNG generator state."""
    out = [np.asarray(v) for v in model.non_trainable_weights]
    for layer in model._flatten_layers():
        gen = getattr(getattr(layer, "_random_generator", None), "_generator", None)
        if gen is not None:
            out.append(gen.state.numpy())
    return out


def run_both(make_model, x, compile_mode, steps=2):
    results = {}
    for on in (False, True):
        model = make_model()

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(model(x, training=True), tf.float32) ** 2)
            return loss, tape.gradient(loss, [x] + model.trainable_weights)

        if compile_mode == "function":
            step = tf.function(step)
        elif compile_mode == "jit":
            step = tf.function(step, jit_compile=True)
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            for _ in range(steps):
                loss, grads = step(x)
        results[on] = ([float(loss)] + to_numpy(grads), CALLS["n"], state_values(model), model)
    return results


@pytest.mark.fast
@pytest.mark.parametrize("compile_mode", ["eager", "function", "jit"])
def test_dropout_batchnorm_gradients_and_state_match(compile_mode):
    r = run_both(build_model, inputs(), compile_mode)
    (g0, c0, s0, m0), (g1, c1, s1, _) = r[False], r[True]
    assert len(g0) == 2 + 3 * 8 + 2
    assert_all_close(g0, g1)
    assert len(s0) == 3 * 2 + 3  # moving mean/var per block + a generator per Dropout
    assert_state_equal(s0, s1)
    assert c1 == 2 * c0 and c0 > 0


def test_function_under_outer_eager_tape():
    x = inputs()
    results = []
    for on in (False, True):
        model = build_model()
        with recompute.recompute_scope(on):
            loss, grads = under_outer_eager_tape(model, x)
        results.append(([float(loss)] + to_numpy(grads), state_values(model)))
    assert_all_close(results[0][0], results[1][0])
    assert_state_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_matches(jit_compile):
    weights_of = lambda model: [np.asarray(v) for v in model.weights] + state_values(model)  # noqa: E731
    weights, calls = fit_both(K, build_model, jit_compile, weights_of, CALLS)
    assert_all_close(weights[0], weights[1])
    assert calls[1] > calls[0]


class DropoutOnly(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = K.layers.Dropout(0.5)

    @recompute_grad
    def call(self, x, training=None):
        return self.drop(x, training=training) * 3.0


def _dropout_step(layer, compile_mode):
    """A step returning (output, d output / d input) of a `x * 3` dropout layer."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return y, tape.gradient(y, x)

    return tf.function(step) if compile_mode == "function" else step


def _assert_backward_used_forward_mask(y, g):
    y, g = y.numpy(), g.numpy()
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7  # dropout really dropped
    # dy/dx = 3 * mask / (1 - rate): the backward pass used the forward pass's mask.
    np.testing.assert_allclose(g, np.where(kept, 6.0, 0.0), rtol=1e-6)


LEGACY_INPUT = tf.random.stateless_uniform((64, 16), seed=(3, 4), minval=1.0, maxval=2.0)


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_legacy_rng_recomputation_sees_forward_masks(compile_mode, monkeypatch):
    K.backend.experimental.disable_tf_random_generator()
    monkeypatch.setattr(_core, "_legacy_rng_warned", False)
    step = _dropout_step(DropoutOnly(), compile_mode)
    with recompute.recompute_scope(True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, g1 = step(LEGACY_INPUT)
        y2, g2 = step(LEGACY_INPUT)
    legacy = [w for w in caught if "legacy stateful" in str(w.message)]
    assert len(legacy) == 1 and "enable_tf_random_generator" in str(legacy[0].message)
    _assert_backward_used_forward_mask(y1, g1)
    _assert_backward_used_forward_mask(y2, g2)
    assert not np.array_equal(y1.numpy() != 0, y2.numpy() != 0)  # new masks each step


class AttentionBlock(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = K.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.2)
        self.ln = K.layers.LayerNormalization()

    @recompute_grad
    def call(self, inputs, attention_mask=None, training=None):
        q, k, v = inputs  # bert4keras passes [x, x, x]
        return self.ln(q + self.mha(q, v, k, attention_mask=attention_mask, training=training))


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_self_attention_same_tensor_three_times(compile_mode):
    x = inputs((2, 5, 8))
    valid = tf.constant([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]) > 0
    attention_mask = valid[:, None, :] & valid[:, :, None]
    results = []
    for on in (False, True):
        K.utils.set_random_seed(0)
        layer = AttentionBlock()
        layer([x, x, x], attention_mask=attention_mask)

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer([x, x, x], attention_mask=attention_mask, training=True)
                loss = tf.reduce_sum(y**2)
            return loss, tape.gradient(loss, [x] + layer.trainable_weights)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            step(x)
            loss, grads = step(x)
        results.append([float(loss)] + to_numpy(grads))
    assert_all_close(results[0], results[1])


def test_add_loss_applied_once_with_its_gradient():
    check_add_loss_applied_once(K, inputs((3, 4)))


def test_mixed_precision_eager_exact():
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        r = run_both(build_model, inputs(), "eager")
        assert r[True][3].layers[1].compute_dtype == "float16"
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert_all_close(r[False][0], r[True][0])
    assert r[True][1] == 2 * r[False][1]


class DropoutAttentionBlock(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = K.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)

    @recompute_grad
    def call(self, x, training=None):
        return self.mha(x, x, training=training)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_attention_with_dropout_eager_exact(policy):
    """Half precision, eager ("full"): a `MultiHeadAttention` with dropout gives
    RECOMPUTE=0's output and gradients (the layer's own core runs: `_flash.runs_blocked`)."""
    x = inputs((2, 37, 16))
    results = []
    K.mixed_precision.set_global_policy(policy)
    try:
        for on in (False, True):
            K.utils.set_random_seed(0)
            tf.random.set_seed(0)
            layer = DropoutAttentionBlock()
            layer(x)
            with recompute.recompute_scope(on), tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
            assert y.dtype == policy.split("_")[1]
            results.append([tf.cast(y, tf.float32)] + to_numpy(
                tape.gradient(loss, [x] + layer.trainable_weights)))
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert_all_close(results[0], results[1])


class LazyBlock(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    @recompute_grad
    def call(self, x):
        self.calls += 1
        if self.calls > 1:
            return x * self.add_weight(name="late", shape=(), initializer="ones")
        return x * 2.0


def test_variable_created_in_recomputation_raises():
    check_variable_creation_refused(LazyBlock(), inputs((2, 3)))


def test_disabled_runs_the_original_call_once():
    model = build_model()
    with recompute.recompute_scope(False):
        CALLS["n"] = 0
        with tf.GradientTape():
            model(inputs(), training=True)
    assert CALLS["n"] == 3


class InlineDropout(K.layers.Layer):
    """Creates its Dropout inside `call`, as bert4keras's attention does."""

    @recompute_grad
    def call(self, x, training=None):
        return K.layers.Dropout(0.5)(x, training=training) * 3.0


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_legacy_rng_dropout_created_inside_call(compile_mode):
    from tf_keras.src.backend import RandomGenerator

    K.backend.experimental.disable_tf_random_generator()
    original = RandomGenerator.__dict__["dropout"]
    step = _dropout_step(InlineDropout(), compile_mode)
    with recompute.recompute_scope(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, g = step(LEGACY_INPUT)
    _assert_backward_used_forward_mask(y, g)
    # The redirect lives only while a decorated call runs.
    assert RandomGenerator.__dict__["dropout"] is original


class Affine(K.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(name="w", shape=input_shape[-1:], initializer="ones")

    @recompute_grad
    def call(self, x):
        return x * self.w


class SquaredAffine(Affine):
    @recompute_grad
    def call(self, x):  # the parent's decorated call runs inside this one
        return super().call(x) ** 2


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_decorated_super_call_is_recomputed_once(compile_mode, monkeypatch):
    calls = count_recomputed_calls(monkeypatch)
    layer = SquaredAffine()
    x = inputs()
    layer(x)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * tf.range(8, dtype=y.dtype))
        return [loss] + tape.gradient(loss, [x, layer.w])

    wrap = tf.function if compile_mode == "function" else (lambda f: f)
    plain = to_numpy(wrap(step)(x))  # a new trace each time: RECOMPUTE is read when tracing
    with recompute.recompute_scope(True):
        recomputed = to_numpy(wrap(step)(x))
    assert_all_close(plain, recomputed)
    # One recomputation: the inner (parent's) call runs plainly inside it,
    # in the forward pass and in the recomputation alike.
    assert calls["n"] == 1


class Outer(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = SquaredAffine()
        self.dense = K.layers.Dense(8, activation="tanh")

    @recompute_grad
    def call(self, x):  # a decorated sublayer runs inside this one
        return self.inner(self.dense(x))


def test_outermost_decorated_call_is_the_unit(monkeypatch):
    calls = count_recomputed_calls(monkeypatch)
    K.utils.set_random_seed(0)
    layer = Outer()
    x = inputs()
    layer(x)

    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * tf.range(8, dtype=tf.float32))
        return [loss] + tape.gradient(loss, [x] + layer.trainable_weights)

    plain = to_numpy(step())
    with recompute.recompute_scope(True):
        recomputed = to_numpy(step())
    assert_all_close(plain, recomputed)
    assert calls["n"] == 1


def masked_model(decorate):
    """Embedding(mask_zero) -> a functional block (decorated or not) -> a mask-consuming pooling."""
    K.utils.set_random_seed(0)
    block_in = K.Input((None, 8))
    block_out = K.layers.Dense(8, activation="tanh")(K.layers.Dense(16, activation="relu")(block_in))
    block = K.Model(block_in, block_out)
    if decorate:
        block.call = recompute_grad(block.call)
    tokens = K.Input((None,), dtype="int32")
    h = K.layers.Embedding(20, 8, mask_zero=True)(tokens)
    h = block(h)
    h = block(h)  # the mask must survive the first block's recomputation wrapper
    return K.Model(tokens, K.layers.Dense(1)(K.layers.GlobalAveragePooling1D()(h)))


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_functional_block_keeps_the_padding_mask(compile_mode):
    tokens = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 1]])
    results = []
    for decorate in (False, True):
        model = masked_model(decorate)

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(tokens, training=True) ** 2)
            return [loss] + tape.gradient(loss, model.trainable_weights)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(True):
            results.append(to_numpy(step()))
    assert_all_close(results[0], results[1])


def test_legacy_rng_recomputed_draws_wait_for_the_gradient():
    """Memory: under the legacy RNG, a recomputed mask is drawn in the backward
    pass (its seed waits for the gradient), not kept from the forward pass."""
    K.backend.experimental.disable_tf_random_generator()
    blocks = [DropoutOnly(), DropoutOnly()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = gradient_graph(blocks, tf.ones([2, 8]))
    ops = graph.get_operations()
    first_grad = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
    recomputed = [op for op in ops[first_grad:]
                  if op.type.startswith("StatelessRandom") and "KeyCounter" not in op.type]
    assert len([op for op in recomputed if op.type == "StatelessRandomUniformV2"]) == 2  # the masks
    for op in recomputed:
        assert any(name.startswith("gradient_tape/") for name in ancestors(op)), op.name
