"""recompute_grad on Keras 3 (TensorFlow backend): numerics against the same model without it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close, assert_state_equal, max_rel_err, to_numpy

CALLS = {"n": 0}


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
        fn = tf.function(lambda x: model(x, training=True))
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            grads = tape.gradient(loss, [x] + model.trainable_variables)
        results.append((to_numpy(grads), CALLS["n"]))
    assert_all_close(results[0][0], results[1][0])
    assert results[1][1] > results[0][1]  # the backward function traced the recomputation


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_matches(jit_compile):
    x = np.random.RandomState(0).randn(32, 8).astype("float32")
    y = np.random.RandomState(1).randn(32, 1).astype("float32")
    weights, calls = [], []
    for on in (False, True):
        model = build_model()
        # Plain SGD: the update is proportional to the gradient, so the weights
        # compare gradients (Adam would amplify last-bit differences of XLA fusions).
        model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
        CALLS["n"] = 0
        with recompute.recompute_scope(on):
            hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append([np.asarray(v) for v in model.variables])
        calls.append(CALLS["n"])
        assert np.all(np.isfinite(hist.history["loss"]))
    assert_all_close(weights[0], weights[1])
    assert calls[1] == 2 * calls[0]  # traced once each; the recompute traces the call again


def test_env_variable_read_at_call_time(monkeypatch):
    x = inputs()
    model = build_model()
    monkeypatch.setenv("RECOMPUTE", "0")
    CALLS["n"] = 0
    train_grads(model, x, "eager", steps=1)
    assert CALLS["n"] == 3
    monkeypatch.setenv("RECOMPUTE", "yes")
    CALLS["n"] = 0
    train_grads(model, x, "eager", steps=1)
    assert CALLS["n"] == 6
    monkeypatch.setenv("RECOMPUTE", "maybe")
    with pytest.raises(ValueError, match="maybe"):
        train_grads(model, x, "eager", steps=1)


def test_no_tape_runs_once():
    model = build_model()
    with recompute.recompute_scope(True):
        CALLS["n"] = 0
        model(inputs(), training=True)
        assert CALLS["n"] == 3
        model.predict(np.zeros((4, 8), "float32"), verbose=0)


def _graph_op_types(model, x, training):
    @tf.function
    def fwd(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=training)
        return y

    return sorted(op.type for op in fwd.get_concrete_function(x).graph.get_operations())


def test_disabled_adds_no_ops():
    x = inputs()
    decorated, plain = build_model(Block), build_model(PlainBlock)
    with recompute.recompute_scope(False):
        assert _graph_op_types(decorated, x, True) == _graph_op_types(plain, x, True)
    with recompute.recompute_scope(True):
        assert _graph_op_types(decorated, x, True) != _graph_op_types(plain, x, True)

    @tf.function
    def infer(x):
        return decorated(x, training=False)

    @tf.function
    def infer_plain(x):
        return plain(x, training=False)

    with recompute.recompute_scope(True):  # no tape: nothing added either
        a = sorted(op.type for op in infer.get_concrete_function(x).graph.get_operations())
        b = sorted(op.type for op in infer_plain.get_concrete_function(x).graph.get_operations())
    assert a == b


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

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(model(x, training=training) ** 2)
            return loss, tape.gradient(loss, [x] + model.trainable_variables)

        if compile_mode == "function":
            step = tf.function(step)
        with recompute.recompute_scope(on):
            for _ in range(3):
                loss, grads = step(x)
        results.append(([float(loss)] + to_numpy(grads), [np.asarray(v) for v in model.non_trainable_variables]))
    assert_all_close(results[0][0], results[1][0])
    assert_all_close(results[0][1], results[1][1], rtol=1e-6)
    # Guard: the statistics did move (training) or stayed (inference).
    moving_mean = results[0][1][0]
    assert np.any(moving_mean != 0) == training


class LossBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    @recompute_grad
    def call(self, x):
        h = self.dense(x)
        self.add_loss(0.1 * tf.reduce_sum(h**2))
        return h


def test_add_loss_applied_once():
    grads, n_losses = [], []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = LossBlock()
        x = inputs((3, 4))
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(y) + tf.add_n(layer.losses)
            g = tape.gradient(loss, [x] + layer.trainable_variables)
        n_losses.append(len(layer.losses))
        grads.append([float(loss)] + to_numpy(g))
    assert n_losses == [1, 1]
    assert_all_close(grads[0], grads[1])


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


class LazyBlock(keras.layers.Layer):
    """Creates a variable only on its second call: the recomputation would create it."""

    def __init__(self, make_variable, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.make_variable = make_variable

    def build(self, input_shape):
        pass

    @recompute_grad
    def call(self, x):
        self.calls += 1
        if self.calls > 1:
            return x * self.make_variable()
        return x * 2.0


@pytest.mark.parametrize(
    "make_variable",
    [lambda: keras.Variable(2.0), lambda: tf.Variable(2.0)],
    ids=["keras.Variable", "tf.Variable"],
)
def test_variable_created_in_recomputation_raises(make_variable):
    layer = LazyBlock(make_variable)
    x = inputs((2, 3))
    with recompute.recompute_scope(True):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        with pytest.raises(recompute.VariableCreatedInRecomputationError, match="build the layer"):
            tape.gradient(y, x)


def test_forward_mode_autodiff_raises():
    layer = Block(8)
    x = inputs()
    layer(x)
    with recompute.recompute_scope(True):
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)):
            with pytest.raises(NotImplementedError, match="ForwardAccumulator"):
                layer(x, training=True)


def test_decorating_wrong_things_raises():
    with pytest.raises(TypeError, match="Received: .*Dense"):
        recompute_grad(keras.layers.Dense(2))
    with pytest.raises(TypeError, match="Received"):
        recompute_grad(keras.layers.Dense)
    with pytest.raises(TypeError, match="named 'forward'"):

        @recompute_grad
        def forward(self, x):
            return x

    class NotALayer:
        @recompute_grad
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="Received: a call on .*NotALayer"):
        NotALayer().call(tf.ones(2))


def test_bound_call_of_an_instance():
    x = inputs()
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(3)
        layer(x)
        layer.call = recompute_grad(layer.call)
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x) ** 2)
        results.append(to_numpy(tape.gradient(loss, [x] + layer.trainable_variables)))
    assert_all_close(results[0], results[1])


def test_scope_overrides_environment(monkeypatch):
    monkeypatch.setenv("RECOMPUTE", "1")
    assert recompute.is_enabled()
    with recompute.recompute_scope(False):
        assert not recompute.is_enabled()
        with recompute.recompute_scope(True):
            assert recompute.is_enabled()
        assert not recompute.is_enabled()
    with pytest.raises(TypeError, match="Received: enabled='yes'"):
        with recompute.recompute_scope("yes"):
            pass


def test_non_tensorflow_backend_raises(monkeypatch):
    # Only the TensorFlow backend can be loaded here (the others need JAX or
    # PyTorch), so the backend Keras reports is patched for this test.
    layer = Block(8)
    x = inputs()
    layer(x)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with recompute.recompute_scope(True):
        with pytest.raises(NotImplementedError, match="'jax' backend"):
            layer(x)
    with recompute.recompute_scope(False):
        layer(x)  # off: the original call runs, whatever the backend


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


class MaskBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)
        self.drop = keras.layers.Dropout(0.5)

    @recompute_grad
    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


def test_recomputed_random_ops_wait_for_the_gradient():
    """Memory: a recomputed dropout mask is drawn in the backward pass, not kept from the forward."""
    blocks = [MaskBlock(), MaskBlock()]
    x = tf.ones([2, 8])
    for b in blocks:
        b(x)

    @tf.function
    def step(x):
        # (traced with recomputation on; see the scope below)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for b in blocks:
                y = b(y, training=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    with recompute.recompute_scope(True):
        graph = step.get_concrete_function(x).graph
    loss_grad = [op for op in graph.get_operations() if op.name.startswith("gradient_tape/")]
    assert loss_grad
    random_ops = [op for op in graph.get_operations()
                  if op.type.startswith("StatelessRandom") and "KeyCounter" not in op.type]
    # Forward draws: 2; recomputed draws: 2 (created after the first gradient op).
    first_grad = graph.get_operations().index(loss_grad[0])
    recomputed = [op for op in random_ops if graph.get_operations().index(op) > first_grad]
    assert len(recomputed) == 2

    def ancestors(op):
        seen, stack = set(), [op]
        while stack:
            o = stack.pop()
            if o.name in seen:
                continue
            seen.add(o.name)
            stack.extend(t.op for t in o.inputs)
            stack.extend(o.control_inputs)
        return seen

    for op in recomputed:
        assert any(name.startswith("gradient_tape/") for name in ancestors(op)), op.name


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
