"""recompute_grad checks for both Keras families: rough edges (non-tensor outputs, misuse
caught early, reload, RNG advice, unconnected gradients). `K` (fixture,
tests.helpers.families) is `keras` or `tf_keras`; tests/recompute_keras3/test_recompute_edge_cases.py
and tests/recompute_tf_keras/test_recompute_edge_cases_tf_keras.py import the tests.
"""

import functools
import types

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.families import is_tf_keras, variable_name
from tests.helpers.numerics import assert_all_close, to_numpy
from tests.helpers.recompute_distributed import unused_model

CALLS = {"n": 0}


@functools.cache
def layers(K):
    """The layers of the checks, as classes of the family `K`."""

    class TupleBlock(K.layers.Layer):
        """Returns the output with optional attention-like weights and non-tensor leaves."""

        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.d1 = K.layers.Dense(units, activation="tanh")
            self.drop = K.layers.Dropout(0.2)
            self.d2 = K.layers.Dense(units)

        @recompute_grad
        def call(self, x, training=None, return_weights=False):
            h = self.drop(self.d1(x), training=training)
            weights = tf.nn.softmax(h) if return_weights else None
            positive = tf.cast(x > 0, tf.int32)  # an integer tensor: no gradient
            extras = {"none": None, "count": 3, "scale": 0.5, "name": "block", "positive": positive}
            return self.d2(h) + x, weights, extras

    class TupleNet(K.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [TupleBlock(8) for _ in range(2)]
            self.head = K.layers.Dense(1)

        def call(self, x, training=None):
            for i, block in enumerate(self.blocks):
                y, weights, extras = block(x, training=training, return_weights=i == 1)
                _check_extras(weights, extras, i == 1)
                x = y * extras["scale"] + tf.cast(extras["positive"], y.dtype) * 0.1
                if weights is not None:
                    x = x + weights
            return self.head(x)

    if is_tf_keras(K):

        @K.utils.register_keras_serializable(package="recompute_edge_cases")
        class CountedDense(K.layers.Dense):
            def call(self, inputs):
                CALLS["n"] += 1
                return super().call(inputs)

    else:

        @K.saving.register_keras_serializable(package="recompute_edge_cases")
        class CountedDense(K.layers.Dense):
            def call(self, inputs, training=None):
                CALLS["n"] += 1
                return super().call(inputs, training=training)

    class InlineDropout(K.layers.Layer):
        @recompute_grad
        def call(self, x, training=None):
            return K.layers.Dropout(0.5)(x, training=training) * 3.0

    class OwnedDropout(K.layers.Layer):
        """The advice followed: the Dropout is created once, in `__init__`."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dropout = K.layers.Dropout(0.5)

        @recompute_grad
        def call(self, x, training=None):
            return self.dropout(x, training=training) * 3.0

    return types.SimpleNamespace(**locals())


def _check_extras(weights, extras, return_weights):
    assert (weights is None) == (not return_weights)
    assert extras["none"] is None
    assert type(extras["count"]) is int and extras["count"] == 3
    assert type(extras["scale"]) is float and extras["scale"] == 0.5
    assert extras["name"] == "block"
    assert extras["positive"].dtype == tf.int32


def _loss(x, outputs):
    y, weights, extras = outputs
    loss = tf.reduce_sum(y**2) * extras["scale"] * extras["count"]
    loss += tf.reduce_sum(tf.cast(extras["positive"], y.dtype) * y)
    if weights is not None:
        loss += tf.reduce_sum(weights * x)
    return loss


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_non_tensor_outputs_pass_through(K, compile_mode, return_weights):
    x = tf.random.stateless_normal((4, 8), seed=(1, 2))
    results = []
    for on in (False, True):
        K.utils.set_random_seed(0)
        layer = layers(K).TupleBlock(8)
        layer(x)
        seen = []

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                outputs = layer(x, training=True, return_weights=return_weights)
                seen.append(outputs)
                loss = _loss(x, outputs)
            return [loss, outputs[0]] + tape.gradient(loss, [x] + layer.trainable_weights)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            values = step(x)
        _, weights, extras = seen[-1]
        _check_extras(weights, extras, return_weights)
        results.append(to_numpy(values))
    assert len(results[0]) == 2 + 1 + 4
    assert_all_close(results[0], results[1])


def test_only_non_float_outputs(K):
    """A call whose outputs carry no gradient returns them unchanged."""

    class Count(K.layers.Layer):
        @recompute_grad
        def call(self, x):
            return tf.shape(x)[0], None

    x = tf.ones((3, 2))
    with recompute.recompute_scope(True):
        with tf.GradientTape() as tape:
            tape.watch(x)
            n, none = Count()(x)
    assert int(n) == 3 and none is None


def test_non_tensor_outputs_in_fit(K):
    x = np.random.RandomState(0).randn(32, 8).astype("float32")
    y = np.random.RandomState(1).randn(32, 1).astype("float32")
    weights = []
    for on in (False, True):
        K.utils.set_random_seed(0)
        model = layers(K).TupleNet()
        model.compile(K.optimizers.SGD(0.05), "mse")
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append([np.asarray(v) for v in model.variables])
    assert_all_close(weights[0], weights[1])


def test_staticmethod_or_plain_function_refused_at_decoration(K):
    with pytest.raises(TypeError, match=r"first parameter is `self`.*Received: `.*Static.call\(x\)`"):

        class Static(K.layers.Layer):
            @staticmethod
            @recompute_grad
            def call(x):
                return x

    with pytest.raises(TypeError, match=r"Received: `.*call\(inputs, training=None\)`"):

        @recompute_grad
        def call(inputs, training=None):
            return inputs

    with pytest.raises(TypeError, match=r"Received: `.*call\(\)`"):

        @recompute_grad
        def call():
            return None

    class Plain:
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="bound `call` of .*Plain"):
        recompute_grad(Plain().call)

    # Still accepted: `self` first, or `self` inside *args.
    class Varargs(K.layers.Layer):
        @recompute_grad
        def call(*args, **kwargs):
            return args[1] * 2.0

    with recompute.recompute_scope(True):
        with tf.GradientTape() as tape:
            x = tf.ones((2, 2))
            tape.watch(x)
            y = Varargs()(x)
    np.testing.assert_array_equal(tape.gradient(y, x), np.full((2, 2), 2.0))


def test_errors_describe_tensors_without_their_values(K):
    class NotALayer:
        @recompute_grad
        def call(self, x):
            return x

    with pytest.raises(TypeError) as info:
        NotALayer().call(tf.ones((40, 50)))
    assert "NotALayer" in str(info.value)
    with pytest.raises(TypeError) as info:
        recompute_grad(tf.ones((40, 50)))
    message = str(info.value)
    assert "shape (40, 50) and dtype float32" in message and "numpy" not in message
    assert len(message) < 300


def _saved_model_with_functional_block(K, path):
    K.utils.set_random_seed(0)
    block_in = K.Input((8,))
    h = K.layers.Dropout(0.2)(layers(K).CountedDense(16, activation="tanh")(block_in))
    block = K.Model(block_in, K.layers.Add()([K.layers.Dense(8)(h), block_in]), name="block")
    block.call = recompute_grad(block.call)
    inp = K.Input((8,))
    model = K.Model(inp, K.layers.Dense(1)(block(inp)))
    model.save(path)


def test_bound_call_decoration_reapplied_after_load(K, tmp_path):
    """The decoration of a bound call is not saved: re-applied after loading, it is exact."""
    path = str(tmp_path / "model.keras")
    _saved_model_with_functional_block(K, path)
    x = tf.random.stateless_normal((4, 8), seed=(1, 2))
    results, calls = [], []
    for on in (False, True):
        K.utils.set_random_seed(1)  # the same dropout seeds in both loads
        model = K.models.load_model(path)
        block = model.get_layer("block")
        assert not hasattr(block.call, "__recompute_grad_wrapped__")  # dropped by the reload
        block.call = recompute_grad(block.call)  # the documented recipe
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            grads = tape.gradient(loss, [x] + model.trainable_weights)
        results.append(to_numpy([loss] + grads))
        calls.append(CALLS["n"])
    assert len(results[0]) == 2 + 6
    assert_all_close(results[0], results[1])
    assert calls == [1, 2]  # recomputed once the decoration is back


def _dropout_grads(layer, compile_mode):
    x = tf.random.stateless_normal((4, 16), seed=(3, 4))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.range(16, dtype=y.dtype))
        return [y, tape.gradient(loss, x)]

    if compile_mode == "function":
        step = tf.function(step)
    return to_numpy(step(x))


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_dropout_created_in_call_gets_advice_that_can_be_followed(K, compile_mode):
    with recompute.recompute_scope(True):
        with pytest.raises(recompute.VariableCreatedInRecomputationError) as info:
            _dropout_grads(layers(K).InlineDropout(), compile_mode)
    message = str(info.value)
    assert "random-number generator" in message
    assert "Create that layer once, in `__init__` or `build`" in message
    assert "calling the model once on a sample batch" not in message
    assert ("disable_tf_random_generator" in message) == (K.__name__ == "tf_keras")
    # Following it: the same masks and gradients as without recomputation.
    results = []
    for on in (False, True):
        K.utils.set_random_seed(0)
        layer = layers(K).OwnedDropout()
        with recompute.recompute_scope(on):
            results.append(_dropout_grads(layer, compile_mode))
    assert 0 < np.mean(results[0][0] == 0) < 1  # dropout is on
    assert_all_close(results[0], results[1])


# ------------------------------------------------- unconnected gradients: None


@pytest.mark.parametrize("compile_mode", ["eager", "function"])
def test_unconnected_gradients_are_none(K, compile_mode):
    x = tf.random.stateless_normal((6, 3), seed=(1, 2))
    results = []
    for on in (False, True):
        model, _ = unused_model(K, units=4, features=3)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            results.append(to_numpy(step(x)))
    names = [variable_name(K, v) for v in model.trainable_variables]
    missing = [[n for n, g in zip(names, grads) if g is None] for grads in results]
    # aux kernel and bias, unused kernel and bias: None, as without recomputation.
    assert len(missing[0]) == 4 and missing[1] == missing[0]
    connected = [i for i, g in enumerate(results[0]) if g is not None]
    assert_all_close(
        [results[0][i] for i in connected], [results[1][i] for i in connected],
        [names[i] for i in connected],
    )


@pytest.mark.parametrize("jit_compile", [False, True])
def test_unconnected_weights_under_weight_decay_fit_matches(K, jit_compile):
    x = np.random.RandomState(0).randn(24, 3).astype("float32")
    y = np.random.RandomState(1).randn(24, 1).astype("float32")
    weights = []
    for on in (False, True):
        model, unconnected = unused_model(K, units=4, features=3)
        model.compile(
            K.optimizers.AdamW(0.01, weight_decay=0.1), "mse", jit_compile=jit_compile
        )
        start = [np.asarray(v) for v in unconnected]
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append([np.asarray(v) for v in model.variables])
        # The unconnected weights are left alone (a zero gradient would decay them).
        for v, v0 in zip(unconnected, start):
            np.testing.assert_array_equal(np.asarray(v), v0, err_msg=variable_name(K, v))
    names = [variable_name(K, v) for v in model.variables]
    for name, w0, w1 in zip(names, *weights):
        np.testing.assert_allclose(w1, w0, rtol=0, atol=1e-6, err_msg=name)




def test_recomputation_reads_a_mask_once_the_gradient_arrives(K):
    """A recomputed call's tensor inputs that are not floating-point (a boolean mask) reach
    its recomputation through the incoming gradient (`recompute.engine._core`'s gate), like
    its float inputs: what the call computes from the mask alone -- here the mask broadcast
    to [batch, seq, seq], as bert4keras's masking does -- is recomputed when the gradient
    arrives. Read straight from the forward pass, a graph executor runs it at once and
    keeps it until the backward pass (bert4keras's "block", BERT-base seq 512: every
    block's [batch, heads, seq, seq] bools alive at once). The values equal RECOMPUTE=0's."""
    from tests.helpers.attention_blocks import ancestors

    class Masked(K.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

        @recompute_grad
        def call(self, x, mask):
            full = tf.broadcast_to(mask[:, None, :], [tf.shape(x)[0], 5, 5])
            scores = tf.einsum("bsd,btd->bst", x * self.w, x)
            return tf.einsum("bst,btd->bsd", tf.where(full, scores, tf.zeros_like(scores)), x)

    layer = Masked()
    x = tf.random.stateless_normal([2, 5, 3], seed=[1, 2])
    mask = tf.constant([[True] * 5, [True] * 3 + [False] * 2])

    def step(x, mask):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, mask) ** 2)
        return loss, tape.gradient(loss, layer.trainable_weights)

    results = []
    for on in (False, True):  # (the switch is read when the step is traced)
        with recompute.recompute_scope(on):
            traced = tf.function(step)
            results.append(to_numpy(traced(x, mask)))
            graph = traced.get_concrete_function(x, mask).graph
    assert_all_close(results[0], results[1])
    ops = graph.get_operations()
    first = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
    recomputed = [op for op in ops[first:] if op.type == "BroadcastTo"]
    assert recomputed
    for op in recomputed:
        assert any(name.startswith("gradient_tape/") for name in ancestors(op)), op.name


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_recomputation_gate_is_a_view_outside_xla(jit_compile):
    """`recompute.engine.after` (the gate every recomputation waits on) makes each tensor
    depend on the gates through its data. Where TensorFlow sees no GPU and XLA does not
    compile the graph it is a slice of the whole tensor whose start is computed from the
    gates (TensorFlow's kernel hands on the buffer: no copy), for floats, integers and
    booleans alike; under `jit_compile` a sum with a zero computed from them. Either way
    the values are the tensors', and the gate is among the gated tensor's ancestors."""
    from recompute.adapters import _tf
    from recompute.engine import after
    from tests.helpers.attention_blocks import ancestors

    x = tf.random.stateless_normal([2, 3, 4], seed=[1, 2])
    n = tf.constant([[1, 2], [3, 4]])
    b = tf.constant([True, False])
    gate = tf.constant([0.5, -1.0])

    @tf.function(jit_compile=jit_compile)
    def gated(x, n, b, gate):
        return after([x, n, b], gate)

    for want, got in zip((x, n, b), gated(x, n, b, gate)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    view = not (jit_compile or _tf.sees_a_gpu())
    graph = gated.get_concrete_function(x, n, b, gate).graph
    gate_op = graph.inputs[3].op.name
    for out, dtype in zip(graph.outputs, (tf.float32, tf.int32, tf.bool)):
        op = out.op
        while op.type == "Identity":
            op = op.inputs[0].op
        expected = "Slice" if view else ("LogicalOr" if dtype == tf.bool else "AddV2")
        assert op.type == expected, (dtype, op.type)
        assert gate_op in ancestors(op), (dtype, op.name)


__all__ = [name for name in dir() if name.startswith("test_")]  # what the suites import
