"""The blocked attention core on Keras 3's JAX backend (forced: `attention_core("blocked")`;
the rule runs it too on JAX in float32): under both policies, with dropout,
padding and causal masks and several block sizes, the loss and every gradient of
RECOMPUTE=0 (jit and `fit`), and no saved residual holds [seq, seq] floats."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import recompute
from recompute import recompute_grad, recompute_scope
from tests.helpers.jax_backend import jaxprs
from tests.helpers.numerics import assert_all_close

SEQ, WIDTH = 12, 16


@pytest.fixture(autouse=True)
def blocked_core():
    """The blocked core forced (the rule, `recompute.attention_core("auto")`, runs it on JAX
    in float32 too: `test_auto_runs_blocked_core_on_jax`)."""
    with recompute.attention_core("blocked"):
        yield


class Block(keras.layers.Layer):
    def __init__(self, policy, causal, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.2, seed=3)
        self.up = keras.layers.Dense(32, activation="gelu")
        self.down = keras.layers.Dense(WIDTH)
        self.drop = keras.layers.Dropout(0.1, seed=4)
        self.norm = keras.layers.LayerNormalization()
        if policy is not None:
            self.call = recompute_grad(self.call, policy=policy)

    def call(self, x, attn=None, training=None):
        a = self.attention(x, x, attention_mask=attn, use_causal_mask=self.causal, training=training)
        h = self.norm(x + a)
        return h + self.drop(self.down(self.up(h)), training=training)


def build(policy, causal, padded, blocks=2):
    keras.utils.set_random_seed(0)
    x = keras.Input((SEQ, WIDTH))
    keys = keras.Input((SEQ,), dtype="bool")
    mask = keras.ops.logical_and(keys[:, None, :], keys[:, :, None]) if padded else None
    h = x
    for _ in range(blocks):
        h = Block(policy, causal)(h, attn=mask)
    return keras.Model([x, keys], keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))


def data(n=3):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, SEQ, WIDTH)).astype("float32")
    keys = np.arange(SEQ)[None, :] < np.array([SEQ, 7, 3][:n])[:, None]
    return x, keys, rng.normal(size=(n, 1)).astype("float32")


def loss_of(model, on):
    """`(loss_fn, trainable)`: the mean squared error of `model` on `data()` as a function of
    its trainable values (`stateless_call`, training, RECOMPUTE `on`)."""
    x, keys, y = data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable):
        with recompute_scope(on):
            out, _ = model.stateless_call(trainable, non_trainable, [x, keys], training=True)
        return jnp.mean((out - y) ** 2)

    return loss_fn, trainable


def step(model, on, block):
    loss_fn, trainable = loss_of(model, on)
    with recompute.attention_block_size(block):
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(trainable)
    return float(loss), [np.asarray(g) for g in grads]


# Each case compiles its own steps (20 to 60 s): each mask alone in blocks of 5 rows, both
# masks also in the default block and (slow) in blocks of 1 row. Every mask at every block
# shape is the engine's test (tests/recompute_keras3/test_blocked_attention_core.py).
@pytest.mark.parametrize("masks, block", [
    ("padding", 5), ("causal", 5), ("causal+padding", None), ("causal+padding", 5),
    pytest.param("causal+padding", 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["full", "attention"])
def test_blocked_cores_match_no_recompute(policy, masks, block):
    causal, padded = "causal" in masks, "padding" in masks
    reference = build(policy, causal, padded)
    loss0, grads0 = step(reference, False, block)
    loss1, grads1 = step(reference, True, block)
    names = [v.path for v in reference.trainable_variables]
    assert_all_close([loss0], [loss1], ["loss"])
    assert_all_close(grads0, grads1, names)
    assert all(np.abs(g).max() > 0 for g, n in zip(grads0, names) if "attention" in n)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(policy):
    x, keys, y = data()
    weights = []
    for on in (False, True):
        model = build(policy, True, True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with recompute_scope(on), recompute.attention_block_size(5):
            model.fit([x, keys], y, batch_size=3, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert_all_close(weights[0], weights[1])


def saved_attention_matrices(model, on):
    """The shapes of the float residuals of the backward pass that hold [.., seq, seq]."""
    _, vjp = jax.vjp(*loss_of(model, on))
    return [leaf.shape for leaf in jax.tree_util.tree_leaves(vjp)
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
            and leaf.ndim >= 3 and leaf.shape[-2:] == (SEQ, SEQ)]


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_no_attention_matrix_is_saved(policy):
    model = build(policy, True, True)
    assert saved_attention_matrices(model, False)  # the check can fail
    assert saved_attention_matrices(model, True) == []


@pytest.mark.parametrize("shape,rows", [((2, 3, 17, 13), 4), ((1, 2, 9, 16), 9), ((3, 1, 10, 24), 3),
                                        ((2, 2, 12, 12), 5)])
def test_keep_bits_are_the_layers_masks(shape, rows):
    """`_flash_jax.keep_bits`, drawn `rows` query rows at a time, is the layer's own
    dropout mask (a padded last block, keys not a multiple of 8), and advances its seed
    generator as the layer does."""
    from recompute.ops import _flash_jax

    batch, heads, queries, keys = shape
    own, blocked = keras.layers.Dropout(0.2, seed=5), keras.layers.Dropout(0.2, seed=5)
    for _ in range(2):  # two draws: the seed moves on alike
        expected = _flash_jax.pack(own(jnp.ones(shape), training=True) != 0)
        bits = _flash_jax.keep_bits(blocked, jnp.zeros((batch, queries, heads, 4)),
                                    [heads, queries, keys], rows)
        assert bits is not None and bits.shape == expected.shape
        np.testing.assert_array_equal(np.asarray(bits), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(own.seed_generator.state.value),
                                  np.asarray(blocked.seed_generator.state.value))


def _values(jaxpr):
    """Every output variable of `jaxpr`'s equations, sub-jaxprs (scan, checkpoint, custom_vjp) included."""
    for inner in jaxprs(jaxpr):
        for eqn in inner.eqns:
            yield from eqn.outvars


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_step_holds_no_whole_attention_matrix(policy):
    """With blocks of 5 of the 12 rows, no value of the jitted training step -- the dropout's
    draw included, drawn block by block -- is a [batch, heads, seq, seq] array of any dtype."""
    model = build(policy, True, True)

    def whole(on):
        loss_fn, trainable = loss_of(model, on)
        with recompute.attention_block_size(5):
            jaxpr = jax.make_jaxpr(jax.value_and_grad(loss_fn))(trainable).jaxpr
        return {str(v.aval) for v in _values(jaxpr)
                if getattr(v.aval, "shape", ())[-3:] == (2, SEQ, SEQ)}

    assert whole(False)  # the check can fail
    assert whole(True) == set()


def _loops_from_nothing(jaxpr):
    """The loops of `jaxpr` (sub-jaxprs included) that start from a buffer that depends on no
    data: a `scan` that stacks ys (its lowering starts them from zeros), or a loop whose
    carried array (rank >= 3) starts as a broadcast constant. XLA's GPU pipeline fused such
    buffers of every layer into one operation at the start of the step
    (`_flash_jax.scan_after`)."""
    from jax.extend.core import Literal

    found = []
    for inner in jaxprs(jaxpr):
        producers = {}
        for eqn in inner.eqns:
            for v in eqn.outvars:
                producers[v] = eqn
            name = eqn.primitive.name
            if name not in ("scan", "while"):
                continue
            if name == "scan":
                first, count = eqn.params["num_consts"], eqn.params["num_carry"]
                if len(eqn.outvars) > count:
                    found.append("scan stacking ys")
            else:
                first = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
                count = len(eqn.invars) - first
            for v in eqn.invars[first:first + count]:
                source = None if isinstance(v, Literal) else producers.get(v)
                if (len(getattr(v.aval, "shape", ())) >= 3 and source is not None
                        and source.primitive.name == "broadcast_in_dim"
                        and isinstance(source.invars[0], Literal)):
                    found.append(f"{name} carrying a broadcast {v.aval}")
    return found


@pytest.mark.fast
@pytest.mark.parametrize("policy", ["full", "attention"])
def test_loops_start_from_the_data(policy):
    """Every loop of the blocked cores (forward, backward, the dropout's draw) in the jitted
    training step starts from buffers computed from its own data, none from constants."""
    def zeros_first(x):  # a zero carry and stacked ys: the check can fail
        return jax.lax.scan(lambda c, i: (c + x[i], c), jnp.zeros(x.shape[1:]), jnp.arange(3))

    assert len(_loops_from_nothing(jax.make_jaxpr(zeros_first)(jnp.ones((3, 2, 2, 2))).jaxpr)) == 2
    model = build(policy, True, True)
    loss_fn, trainable = loss_of(model, True)
    with recompute.attention_block_size(5):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss_fn))(trainable).jaxpr
    assert any(e.primitive.name in ("scan", "while")
               for inner in jaxprs(jaxpr) for e in inner.eqns)  # blocked
    assert _loops_from_nothing(jaxpr) == []



@pytest.mark.parametrize("policy", ["full", "attention"])
def test_auto_runs_blocked_core_on_jax(policy):
    """The rule (`attention_core("auto")`, the default) runs the blocked core on JAX in
    float32 (since 2026-11-28: XLA:GPU's plan of it is at or below Keras's core's,
    `test_gpu_plan.py`): the step loops (the blocked core's `fori_loop`s: `scan` or
    `while`) and its gradients equal RECOMPUTE=0's; `attention_core("keras")` runs
    Keras's own core, which does not loop."""
    model = build(policy, causal=False, padded=True)
    recomputed, trainable = loss_of(model, on=True)
    reference, _ = loss_of(model, on=False)

    def loops():
        with recompute.attention_block_size(5):  # 3 blocks of the 12 queries
            jaxpr = jax.make_jaxpr(jax.grad(recomputed))(trainable).jaxpr
        return sum(e.primitive.name in ("while", "scan") for j in jaxprs(jaxpr) for e in j.eqns)

    with recompute.attention_core("keras"):
        keras_loops = loops()
    with recompute.attention_core("auto"):
        assert loops() > keras_loops
        assert_all_close(jax.grad(reference)(trainable), jax.grad(recomputed)(trainable))
