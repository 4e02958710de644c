"""recompute_grad on Keras 3: loss and every gradient equal the same model without it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close, assert_state_equal, max_rel_err, to_numpy
from tests.helpers.k3_blocks import CALLS, DropoutAttentionBlock, build_model, inputs, run_both
from tests.helpers.recompute_runs import fit_both, under_outer_eager_tape


@pytest.mark.fast
@pytest.mark.parametrize("compile_mode", ["eager", "function", "jit"])
def test_dropout_gradients_and_state_match(compile_mode):
    r = run_both(build_model, inputs(), compile_mode)
    (l0, g0, c0, s0, m0), (l1, g1, c1, s1, _) = r[False], r[True]
    names = ["input"] + [v.path for v in m0.trainable_variables]
    assert len(g0) == 1 + 3 * 6 + 2
    assert_all_close([l0], [l1], ["loss"])
    assert_all_close(g0, g1, names)
    # Seed generators end exactly where the plain run leaves them.
    assert_state_equal(s0, s1)
    # Recomputation really happened: every block ran twice per gradient.
    assert c1 == 2 * c0 and c0 > 0


def test_dropout_is_really_on():
    """Guard for the test above: with dropout, training outputs differ from inference."""
    model = build_model()
    x = inputs()
    assert not np.allclose(model(x, training=True), model(x, training=False))


def test_function_under_outer_eager_tape():
    x = inputs()
    results = []
    for on in (False, True):
        model = build_model()
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            _, grads = under_outer_eager_tape(model, x)
        results.append((to_numpy(grads), CALLS["n"]))
    assert_all_close(results[0][0], results[1][0])
    assert results[1][1] > results[0][1]  # the backward function traced the recomputation


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_matches(jit_compile):
    weights_of = lambda model: [np.asarray(v) for v in model.variables]  # noqa: E731
    weights, calls = fit_both(keras, build_model, jit_compile, weights_of, CALLS)
    assert_all_close(weights[0], weights[1])
    assert calls[1] == 2 * calls[0]  # traced once each; the recompute traces the call again


class NestedBlock(keras.layers.Layer):
    """Nested dict/list inputs, an int tensor, a bool mask, Python kwargs, a duplicated tensor."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q = keras.layers.Dense(4)
        self.k = keras.layers.Dense(4)
        self.drop = keras.layers.Dropout(0.5)

    @recompute_grad
    def call(self, inputs, ids=None, mask=None, scale=1.0, training=None):
        a = inputs["a"]
        b, c = inputs["pair"]
        h = self.q(a) * scale + self.k(b) * c + tf.cast(ids[:, None], a.dtype)
        if mask is not None:
            h = h * tf.cast(mask[:, None], h.dtype)
        return {"out": self.drop(h, training=training), "count": tf.shape(ids)[0]}


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_nested_kwargs_and_duplicated_inputs(compile_mode):
    a = inputs((5, 3), (1, 1))
    c = inputs((5, 4), (2, 2))
    ids = tf.constant([0, 1, 2, 3, 4])
    mask = tf.constant([True, False, True, True, False])
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = NestedBlock()

        def step(a, c):
            with tf.GradientTape() as tape:
                tape.watch([a, c])
                # `a` is passed twice (as "a" and as "b"): its gradient must be counted once.
                out = layer({"a": a, "pair": [a, c]}, ids=ids, mask=mask, scale=2.0, training=True)
                loss = tf.reduce_sum(out["out"] ** 2)
            return loss, out["count"], tape.gradient(loss, [a, c] + layer.trainable_variables)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            loss, count, grads = step(a, c)
        assert int(count) == 5
        results.append([float(loss)] + to_numpy(grads))
    assert_all_close(results[0], results[1])


class AttentionBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.2)
        self.ln = keras.layers.LayerNormalization()

    @recompute_grad
    def call(self, x, attention_mask=None, training=None):
        return self.ln(x + self.mha(x, x, x, attention_mask=attention_mask, training=training))


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_self_attention_with_padding_mask(compile_mode):
    x = inputs((2, 5, 8))
    valid = tf.constant([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]) > 0
    attention_mask = valid[:, None, :] & valid[:, :, None]
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = AttentionBlock()
        layer(x, attention_mask=attention_mask)  # build

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x, attention_mask=attention_mask, training=True) ** 2)
            return loss, tape.gradient(loss, [x] + layer.trainable_variables)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            loss, grads = step(x)
            loss, grads = step(x)
        results.append([float(loss)] + to_numpy(grads))
    assert len(results[0]) == 2 + 8 + 2
    assert_all_close(results[0], results[1])


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        make = lambda: build_model(head_dtype="float32")
        eager = run_both(make, inputs(), "eager")
        graph = run_both(make, inputs(), "function")
    finally:
        keras.config.set_dtype_policy(previous)
    assert eager[True][4].layers[1].compute_dtype == policy.split("_")[1]
    # Eager: every op runs as written, so recomputation is exact in half precision too.
    assert_all_close([eager[False][0]] + eager[False][1], [eager[True][0]] + eager[True][1])
    assert eager[True][2] == 2 * eager[False][2]
    # tf.function: grappler fuses the forward ops differently when their
    # intermediates are not needed by a gradient, which changes half-precision
    # rounding. The recomputed gradients must stay within the rounding that the
    # graph optimizer introduces on its own (plain eager vs plain tf.function).
    noise = max(max_rel_err(a, b) for a, b in zip(eager[False][1], graph[False][1]))
    err = max(max_rel_err(a, b) for a, b in zip(graph[False][1], graph[True][1]))
    assert noise < 0.05, noise
    assert err <= 2 * noise, (err, noise)


@pytest.mark.parametrize("recompute_policy", ["full", "attention"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_attention_with_dropout(policy, recompute_policy):
    """Half precision, eager: a `MultiHeadAttention` with dropout gives RECOMPUTE=0's
    output and gradients (Keras's own core runs there: `_flash.runs_blocked`), compared
    with RECOMPUTE=0 in the same dtype. Seq 37, one query block."""
    x = inputs((2, 37, 16))
    results = []
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        for on in (False, True):
            keras.utils.set_random_seed(0)
            layer = DropoutAttentionBlock(recompute_policy)
            layer(x)  # build
            with recompute.recompute_scope(on), tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
            grads = tape.gradient(loss, [x] + layer.trainable_variables)
            assert y.dtype == policy.split("_")[1]
            results.append([tf.cast(y, tf.float32)] + to_numpy(grads))
    finally:
        keras.config.set_dtype_policy(previous)
    names = ["output", "input"] + [v.path for v in layer.trainable_variables]
    if recompute_policy == "attention":
        # Under "attention" the core is a recomputed unit of its own: the input's three
        # gradients (through the query, key and value projections) reach it in another
        # order and are summed in another order -- half-precision rounding of that sum
        # alone, with Keras's own core as with any (so too with dropout 0). Every other
        # value is RECOMPUTE=0's.
        assert max_rel_err(results[0][1], results[1][1]) < 2e-2
        del names[1], results[0][1], results[1][1]
    assert_all_close(results[0], results[1], names)


class BranchBlock(keras.layers.Layer):
    """Python control flow on a tensor: needs AutoGraph inside tf.function."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    @recompute_grad
    def call(self, x):
        h = self.dense(x)
        if tf.reduce_sum(h) > 0:
            h = h * 2.0
        else:
            h = -h
        return h


def test_tensor_dependent_python_control_flow_in_graph():
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = BranchBlock()

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x) ** 2)
            return loss, tape.gradient(loss, [x] + layer.trainable_variables)

        with recompute.recompute_scope(on):
            results.append([float(v) for v in [step(inputs((3, 4)))[0]]] + to_numpy(step(inputs((3, 4)))[1]))
    assert_all_close(results[0], results[1])


class EmbeddingBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(50, 8)
        self.dense = keras.layers.Dense(8)
        self.drop = keras.layers.Dropout(0.2)

    @recompute_grad
    def call(self, ids, x, training=None):
        return self.drop(self.dense(self.emb(ids) + x), training=training)


@pytest.mark.parametrize("compile_mode", ["eager", "function", "jit"])
def test_embedding_inside_keeps_sparse_gradient(compile_mode):
    ids = tf.constant([[1, 2, 3], [3, 4, 1]])
    x = inputs((2, 3, 8))
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = EmbeddingBlock()
        layer(ids, x)

        def step(ids, x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(ids, x, training=True) ** 2)
            return loss, tape.gradient(loss, [x] + layer.trainable_variables)

        if compile_mode == "function":
            step = tf.function(step)
        elif compile_mode == "jit":
            step = tf.function(step, jit_compile=True)
        with recompute.recompute_scope(on):
            loss, grads = step(ids, x)
        assert isinstance(grads[1], tf.IndexedSlices)  # the embedding table's gradient
        results.append([float(loss)] + to_numpy(grads))
    assert_all_close(results[0], results[1])
