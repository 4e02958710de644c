"""recompute_grad on Keras 3's JAX backend: RECOMPUTE=1 gives the loss, every gradient and
every state update of RECOMPUTE=0 (seeded and unseeded dropout, BatchNorm, add_loss),
through `stateless_call` under `jax.grad` (jit and not), `fit` (jit and not), `evaluate`
and `predict`; the backward pass keeps only the blocks' inputs (JAX's saved residuals)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import recompute
from recompute import recompute_grad, recompute_scope
from tests.helpers.numerics import assert_all_close

FEATURES = 16


class Block(keras.layers.Layer):
    """Dense-GELU, seeded and unseeded dropout, BatchNorm, an `add_loss`, a residual."""

    def __init__(self, seed=None, adds_loss=True, **kwargs):
        super().__init__(**kwargs)
        self.adds_loss = adds_loss
        self.up = keras.layers.Dense(32, activation="gelu")
        self.drop = keras.layers.Dropout(0.3, seed=seed)
        self.drop2 = keras.layers.Dropout(0.2)  # unseeded: its own random seed generator
        self.norm = keras.layers.BatchNormalization()
        self.down = keras.layers.Dense(FEATURES)

    @recompute_grad
    def call(self, x, training=None):
        h = self.drop2(self.drop(self.up(x), training=training), training=training)
        h = self.norm(h, training=training)
        if self.adds_loss:
            self.add_loss(1e-3 * keras.ops.mean(h**2))
        return x + self.down(h)


def build(seed=0, blocks=2, loss_blocks=None, block=Block):
    """`blocks` blocks (`block`, a `Block` class); the first `loss_blocks` of them (all by
    default) call `add_loss`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = inputs
    for i in range(blocks):
        h = block(seed=10 + i, adds_loss=loss_blocks is None or i < loss_blocks)(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def stateless_step(model, on, jit):
    """loss, gradients and new non-trainable values of one `stateless_call` under `jax.grad`."""
    x, y = data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable, non_trainable):
        with recompute_scope(on):
            out, new_non_trainable, losses = model.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True
            )
        return jnp.mean((out - y) ** 2) + sum(losses), new_non_trainable

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if jit:
        grad_fn = jax.jit(grad_fn)
    (loss, new_state), grads = grad_fn(trainable, non_trainable)
    return float(loss), [np.asarray(g) for g in grads], [np.asarray(s) for s in new_state]


def assert_recompute_matches(model, jit, state=True):
    """`stateless_step` with recomputation equals it without: the loss (to 1e-6), every
    gradient and, with `state`, every new non-trainable value. Returns the loss without and
    the step with: `(loss0, (loss1, grads1, state1))`."""
    loss0, grads0, state0 = stateless_step(model, False, jit)
    loss1, grads1, state1 = stateless_step(model, True, jit)
    assert abs(loss0 - loss1) <= 1e-6 * abs(loss0)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])
    if state:
        assert_all_close(state0, state1, [v.path for v in model.non_trainable_variables])
    return loss0, (loss1, grads1, state1)


@pytest.mark.fast
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
def test_stateless_call_under_grad_matches(jit):
    model = build()
    # Seeds advanced and BatchNorm statistics updated once, as without recomputation.
    _, (_, _, state1) = assert_recompute_matches(model, jit)
    before = [np.asarray(v.value) for v in model.non_trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(before, state1))


def test_gradient_jaxpr_holds_a_checkpoint():
    model = build()
    x, _ = data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def jaxpr(on):
        def loss_fn(trainable):
            with recompute_scope(on):
                out, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.sum(out)

        return str(jax.make_jaxpr(jax.grad(loss_fn))(trainable))

    assert "checkpoint" not in jaxpr(False) and "remat" not in jaxpr(False)
    assert jaxpr(True).count("checkpoint") + jaxpr(True).count("remat") >= 2


@pytest.mark.parametrize("jit_compile", [True, False], ids=["jit", "nojit"])
def test_fit_evaluate_predict_match(jit_compile):
    # One block adds a loss here, not two: Keras 3.15's `stateless_call` runs the model's
    # `call` without entering it, so each block is an entry layer that clears, from the
    # scope's losses, those whose id() it recorded at the previous step -- an id a freed
    # tensor's successor may reuse. Eager `fit` then drops the first block's loss about once
    # in 480 steps, with RECOMPUTE=0 as with 1 (seen in CI). Two losses are threaded through
    # `stateless_call` under `jax.grad` above.
    x, y = data(64)
    results = []
    for on in (False, True):
        model = build(loss_blocks=1)
        model.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=jit_compile)
        with recompute_scope(on):
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            evaluated = model.evaluate(x, y, verbose=0)
            predicted = model.predict(x, verbose=0)
        results.append((model.get_weights(), history.history["loss"], evaluated, predicted))
    (w0, h0, e0, p0), (w1, h1, e1, p1) = results
    np.testing.assert_allclose(h0, h1, rtol=1e-5)
    np.testing.assert_allclose(e0, e1, rtol=1e-5)
    assert_all_close(w0, w1)
    np.testing.assert_allclose(p0, p1, rtol=1e-5, atol=1e-6)


class Routed(keras.layers.Layer):
    """Nested inputs, an integer mask, Python keywords, a tuple output with a None."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(FEATURES)
        self.b = keras.layers.Dense(FEATURES)
        self.drop = keras.layers.Dropout(0.5, seed=3)

    @recompute_grad
    def call(self, inputs, training=None, row_mask=None, scale=1.0, mode="sum"):
        h = self.a(inputs["x"]) * scale
        if mode == "sum":
            h = h + self.b(inputs["pair"][1])
        if row_mask is not None:
            h = h * keras.ops.cast(row_mask, h.dtype)[:, None]
        return self.drop(keras.ops.tanh(h), training=training), None


def test_nested_inputs_mask_python_kwargs():
    keras.utils.set_random_seed(1)
    layer = Routed()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, FEATURES)).astype("float32")
    z = rng.normal(size=(4, FEATURES)).astype("float32")
    mask = np.array([1, 0, 1, 1], "int32")
    layer({"x": x, "pair": (x, z)})
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def grads(on):
        def loss_fn(trainable, x, z):
            with recompute_scope(on):
                (out, none), _ = layer.stateless_call(
                    trainable, non_trainable, {"x": x, "pair": (x, z)},
                    training=True, row_mask=mask, scale=2.0, mode="sum",
                )
            assert none is None
            return jnp.sum(out * jnp.arange(FEATURES))

        return jax.jit(jax.grad(loss_fn, argnums=(0, 1, 2)))(trainable, x, z)

    g0, g1 = grads(False), grads(True)
    flat0, flat1 = jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)
    assert_all_close([np.asarray(g) for g in flat0], [np.asarray(g) for g in flat1])


class GlobalSeed(keras.layers.Layer):
    """Draws from Keras's global seed generator (an unseeded `keras.random` call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(FEATURES)

    @recompute_grad
    def call(self, x):
        return keras.random.dropout(self.dense(x), 0.5)


def test_global_seed_generator_eager():
    """Unseeded draws work only outside traced code on JAX (Keras's rule); under
    `jax.grad` without `jit` they are replayed exactly and advance the global seed once."""
    from keras.src.random.seed_generator import global_seed_generator

    layer = GlobalSeed()
    x = data(4)[0]
    layer(x)
    trainable = [v.value for v in layer.trainable_variables]

    def run(on):
        keras.utils.set_random_seed(5)
        state = global_seed_generator().state

        def loss_fn(trainable):
            with keras.StatelessScope([(state, state.value)]) as scope:
                with recompute_scope(on):
                    out, _ = layer.stateless_call(trainable, [], x)
            return jnp.sum(out**2), scope.get_current_value(state)

        (loss, new_seed), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        return float(loss), [np.asarray(g) for g in grads], np.asarray(new_seed)

    loss0, grads0, seed0 = run(False)
    loss1, grads1, seed1 = run(True)
    assert loss0 == pytest.approx(loss1, rel=1e-6)
    assert_all_close(grads0, grads1)
    np.testing.assert_array_equal(seed0, seed1)


class Counter(keras.layers.Layer):
    """A call that updates a state variable (like a metric): once per call, not per recomputation."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(FEATURES)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    @recompute_grad
    def call(self, x):
        self.calls.assign(self.calls + 1.0)
        return self.dense(x)


def test_state_updated_once_per_call_in_fit():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    counter = Counter()
    model = keras.Model(inputs, keras.layers.Dense(1)(counter(inputs)))
    model.compile("sgd", "mse")
    x, y = data(32)
    with recompute_scope(True):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert float(counter.calls.value) == 4.0


def test_nested_decorated_calls_are_one_unit():
    class Outer(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = Block(seed=1)

        @recompute_grad
        def call(self, x, training=None):
            return self.inner(x, training=training)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, keras.layers.Dense(1)(Outer()(inputs)))
    assert_recompute_matches(model, True)


def test_variable_created_in_recomputed_call_is_refused():
    class Lazy(keras.layers.Layer):
        """Its sublayer is built by its first call (its `build` leaves it), here a recomputed one."""

        def __init__(self):
            super().__init__()
            self.late = keras.layers.Dense(2)

        def build(self, input_shape):
            pass

        @recompute_grad
        def call(self, x):
            return self.late(x)

    layer = Lazy()
    x = data(2)[0]
    with recompute_scope(True), pytest.raises(recompute.VariableCreatedInRecomputationError):
        jax.grad(lambda x: jnp.sum(layer(x)))(x)


class Encoder(keras.layers.Layer):
    """A transformer block: `MultiHeadAttention`, a GELU feed-forward, LayerNorm, dropout."""

    def __init__(self, policy="full", **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(4, 8, dropout=0.1, seed=7)
        self.ffn_up = keras.layers.Dense(128, activation="gelu")
        self.ffn_down = keras.layers.Dense(32)
        self.drop = keras.layers.Dropout(0.1, seed=8)
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()
        self.call = recompute_grad(self.call, policy=policy)

    def call(self, x, training=None):
        h = self.norm1(x + self.attention(x, x, training=training))
        return self.norm2(h + self.drop(self.ffn_down(self.ffn_up(h)), training=training))


def encoder_model(policy, blocks=8, seq=64):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, 32))
    h = inputs
    for _ in range(blocks):
        h = Encoder(policy)(h)
    return keras.Model(inputs, h)


def residual_leaves(model, on, x):
    """The arrays JAX keeps for the backward pass of `sum(model(x)**2)` (the leaves of its
    VJP), each once, the weights left out."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable):
        with recompute_scope(on):
            out, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(out**2)

    _, vjp = jax.vjp(loss_fn, trainable)
    seen = {id(w) for w in trainable}
    leaves = []
    for leaf in jax.tree_util.tree_leaves(vjp):
        if hasattr(leaf, "nbytes") and id(leaf) not in seen:
            seen.add(id(leaf))
            leaves.append(leaf)
    return leaves


def residual_bytes(model, on, x):
    """Bytes of `residual_leaves`."""
    return sum(leaf.nbytes for leaf in residual_leaves(model, on, x))


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_encoder_policies_match_and_keep_less(policy):
    model = encoder_model(policy, blocks=2, seq=16)
    loss0, grads0, state0 = stateless_step_seq(model, False)
    loss1, grads1, state1 = stateless_step_seq(model, True)
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0)
    assert_all_close(grads0, grads1, [v.path for v in model.trainable_variables])
    assert_all_close(state0, state1)


def stateless_step_seq(model, on, x=None):
    """Loss, every gradient and the new state of one jitted training step on `x` (default: a
    batch of 2 drawn for the model's input)."""
    if x is None:
        x = np.random.default_rng(3).normal(
            size=(2,) + tuple(model.input_shape[1:])).astype("float32")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable):
        with recompute_scope(on):
            out, new_state = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(out * jnp.cos(out)), new_state

    (loss, state), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(trainable)
    return float(loss), [np.asarray(g) for g in grads], [np.asarray(s) for s in state]


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_attention_policy_without_attention_layer_is_refused(on):
    from tests.helpers import attention_blocks

    attention_blocks.check_attention_policy_needs_attention_layers(keras, on)


def test_residuals_of_an_8_block_encoder_fall_3x():
    x = np.random.default_rng(0).normal(size=(4, 64, 32)).astype("float32")
    off = residual_bytes(encoder_model("full"), False, x)
    full = residual_bytes(encoder_model("full"), True, x)
    attention = residual_bytes(encoder_model("attention"), True, x)
    assert off >= 3 * full, (off, full)
    assert full < attention < off, (off, full, attention)


def test_attention_policy_gelus_keep_their_input():
    """Under "attention" the exact GELU of `ffn_up` keeps only its input: per block one
    [batch, seq, 128] residual, where autodiff keeps four. (The block runs as one
    checkpoint keeping named values, `policies._jax._block_checkpointed`: the GELU's output,
    which `ffn_down` reads for its weight gradient, is recomputed from its input too;
    before, with `_gelu.checkpointed`, it was kept: two.)"""
    x = np.random.default_rng(0).normal(size=(2, 16, 32)).astype("float32")
    model = encoder_model("attention", blocks=2, seq=16)

    def ffn_wide(on):
        return [leaf for leaf in residual_leaves(model, on, x) if leaf.shape == (2, 16, 128)]

    assert len(ffn_wide(False)) == 4 * 2
    assert len(ffn_wide(True)) == 1 * 2
    gelus = [lyr.ffn_up.activation for lyr in model.layers if isinstance(lyr, Encoder)]
    assert gelus and all(fn is keras.activations.gelu for fn in gelus)  # restored after the call


def test_torch_and_other_backends_are_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    layer = keras.layers.Dense(2)
    with pytest.raises(NotImplementedError, match="TensorFlow or JAX backend. Received: layer '.*' running on the 'torch' backend"):
        layer.call = recompute_grad(layer.call)


def test_exact_float32_pins_jax_and_restores():
    from tests.helpers.numerics import check_exact_float32

    check_exact_float32()
