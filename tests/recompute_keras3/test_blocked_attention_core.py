"""The blocked attention core (`recompute.ops._flash`: FlashAttention-2) on both engines against
autodiff of the unblocked core: outputs and the gradients of queries, keys and values, with
padding and causal masks (fully masked rows included), dropout bits, row blocks that divide
the queries and that do not, key blocks with a running maximum (padded keys), unrolled
blocks and loops."""

import numpy as np
import pytest

import recompute
from recompute.ops import _flash
from tests.helpers.numerics import assert_all_close

B, T, S, N, H = 2, 10, 9, 3, 4  # causal: the first row is fully masked
RATE = 0.25


def _inputs(mask_kind):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, N, H)).astype("float32")
    k = rng.normal(size=(B, S, N, H)).astype("float32")
    v = rng.normal(size=(B, S, N, H + 1)).astype("float32")
    d_out = rng.normal(size=(B, T, N, H + 1)).astype("float32")
    keep = rng.random((B, N, T, S)) > RATE
    lengths = np.array([S, 5])
    padding = np.arange(S)[None, None, None, :] < lengths[:, None, None, None]  # [B, 1, 1, S]
    causal = np.arange(S)[None, None, None, :] <= np.arange(T)[None, None, :, None] + (S - T)
    mask = {"none": None, "padding": np.broadcast_to(padding, (B, 1, T, S)).copy(),
            "keys": padding, "causal": np.broadcast_to(causal & padding, (B, 1, T, S)).copy()}[mask_kind]
    return q, k, v, d_out, keep, mask


class _TF:
    def __init__(self):
        import tensorflow as tf

        from recompute.ops import _flash_tf

        self.tf, self.engine = tf, _flash_tf

    def probabilities(self, q, k, mask):
        tf = self.tf
        s = tf.einsum(_flash.SCORES, q * 0.5, k)
        if mask is None:
            return tf.nn.softmax(s)
        return tf.where(mask, tf.nn.softmax(tf.where(mask, s, -1e9)), 0.0)

    def logits(self, q, k, mask):
        s = self.tf.einsum(_flash.SCORES, q * 0.5, k)
        return (s, None) if mask is None else (self.tf.where(mask, s, -1e9), mask)

    def run(self, fn, q, k, v, d_out):
        tf = self.tf
        q, k, v = (tf.constant(a) for a in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = fn(q, k, v)
        grads = tape.gradient(out, [q, k, v], output_gradients=tf.constant(d_out))
        return [np.asarray(x) for x in [out] + grads]

    def reference(self, mask, keep):
        tf = self.tf
        return lambda q, k, v: tf.einsum(_flash.COMBINE, self.engine.ENGINE.drop(
            self.probabilities(q, k, mask), tf.constant(keep), RATE), v)

    def blocked(self, mask, keep, block, graph):
        tf = self.tf
        mask = None if mask is None else tf.constant(mask)
        bits = self.engine.pack(tf.constant(keep))
        rows, keys = block
        fn = lambda q, k, v: self.engine.attention(self.logits, q, k, v, mask, bits, RATE, rows, keys)
        return tf.function(fn) if graph else fn


class _JAX:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        from recompute.ops import _flash_jax

        self.jax, self.jnp, self.engine = jax, jnp, _flash_jax

    def probabilities(self, q, k, mask):
        jnp = self.jnp
        s = jnp.einsum(_flash.SCORES, q * 0.5, k)
        if mask is None:
            return self.jax.nn.softmax(s)
        return jnp.where(mask, self.jax.nn.softmax(jnp.where(mask, s, -1e9)), 0.0)

    def logits(self, q, k, mask):
        s = self.jnp.einsum(_flash.SCORES, q * 0.5, k)
        return (s, None) if mask is None else (self.jnp.where(mask, s, -1e9), mask)

    def run(self, fn, q, k, v, d_out):
        # Float32 products: this TensorFlow process imported JAX after conftest pinned
        # precision, so JAX's default (TF32 on a GPU) would hold here.
        with self.jax.default_matmul_precision("highest"):
            out, pullback = self.jax.vjp(fn, q, k, v)
            return [np.asarray(x) for x in (out,) + tuple(pullback(d_out))]

    def reference(self, mask, keep):
        jnp = self.jnp
        return lambda q, k, v: jnp.einsum(_flash.COMBINE, self.engine.ENGINE.drop(
            self.probabilities(q, k, mask), jnp.asarray(keep), RATE), v)

    def blocked(self, mask, keep, block, graph):
        bits = self.engine.pack(self.jnp.asarray(keep))
        rows, keys = block
        fn = lambda q, k, v: self.engine.attention(self.logits, q, k, v, mask, bits, RATE, rows, keys)
        return self.jax.jit(fn) if graph else fn


ENGINES = {"tf": _TF, "jax": _JAX}


BLOCKS = {"1": (1, None), "3": (3, None), "7": (7, None), "16": (16, None),  # (rows, keys)
          "3x8": (3, 8), "1x8": (1, 8)}  # 1: 10 row blocks, a loop; 8 keys of 9: 2 key blocks


# Traced (`tf.function`, `jax.jit`), every block shape; eagerly, the same engine code at the
# shapes that loop over row blocks ("1") and over key blocks ("3x8").
@pytest.mark.parametrize("block, graph", [
    pytest.param(block, graph, id=f"{block}-{'graph' if graph else 'eager'}")
    for block in BLOCKS for graph in (False, True) if graph or block in ("1", "3x8")])
@pytest.mark.parametrize("mask", ["none", "padding", "keys", "causal"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_blocked_core_matches_autodiff(engine, mask, block, graph):
    e = ENGINES[engine]()
    q, k, v, d_out, keep, m = _inputs(mask)
    reference = e.run(e.reference(m, keep), q, k, v, d_out)
    blocked = e.run(e.blocked(m, keep, BLOCKS[block], graph), q, k, v, d_out)
    assert_all_close(reference, blocked, ["output", "d_query", "d_key", "d_value"])
    assert np.abs(reference[0]).max() > 0.1 and np.abs(reference[1]).max() > 0.01


@pytest.mark.parametrize("mask", ["padding", "causal"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_key_blocks_in_loops(engine, mask, monkeypatch):
    """Row blocks and key blocks each a loop of the engine's (beyond `UNROLL` blocks)."""
    monkeypatch.setattr(_flash, "UNROLL", 1)
    e = ENGINES[engine]()
    q, k, v, d_out, keep, m = _inputs(mask)
    reference = e.run(e.reference(m, keep), q, k, v, d_out)
    blocked = e.run(e.blocked(m, keep, (3, 8), True), q, k, v, d_out)
    assert_all_close(reference, blocked, ["output", "d_query", "d_key", "d_value"])


@pytest.mark.parametrize("engine", list(ENGINES))
def test_bits_round_trip(engine):
    e = ENGINES[engine]()
    for keys in (1, 7, 8, 9, 17):
        keep = np.random.default_rng(keys).random((2, 3, 4, keys)) > 0.5
        bits = np.asarray(e.engine.pack(keep))
        assert bits.shape == (2, 3, 4, -(-keys // 8)) and bits.dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(e.engine.ENGINE.unpack(bits, keys)), keep)


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_tf_unpacking_by_words_and_by_shifts(mode):
    """TensorFlow's unpacking: by words (`_SPREAD`, `_SELECT` and a bitcast) where the bits'
    shape is known when traced, by shifts where it is not (XLA refuses the bitcast of a
    bounded dimension); the same flags either way, in eager mode, `tf.function` and XLA.
    And `rows_at`, the loops' rows read as one slice: `x[start:start + size]`."""
    import tensorflow as tf

    from recompute.ops import _flash_tf

    engine = _flash_tf.ENGINE
    for keys in (8, 9, 24):
        keep = np.random.default_rng(keys).random((2, 3, 5, keys)) > 0.3
        bits = _flash_tf.pack(keep)
        for signature in (tf.TensorSpec(bits.shape, tf.uint8),
                          tf.TensorSpec([None, 3, None, bits.shape[-1]], tf.uint8)):
            def unpack(b, keys=keys):
                return engine.unpack(b, keys)

            if mode == "eager":
                flags = unpack(bits)
            else:
                fn = tf.function(unpack, input_signature=[signature], jit_compile=mode == "jit")
                flags = fn(bits)
                ops = {op.type for op in fn.get_concrete_function().graph.get_operations()}
                assert ("Bitcast" in ops) == signature.shape.is_fully_defined(), ops
                assert ("RightShift" in ops) != signature.shape.is_fully_defined(), ops
            np.testing.assert_array_equal(flags.numpy(), keep)

    x = tf.reshape(tf.range(4 * 3 * 2, dtype=tf.float32), [4, 3, 2])

    def rows(x, start):
        return _flash_tf.rows_at(x, start, 2)

    if mode != "eager":
        rows = tf.function(rows, input_signature=[tf.TensorSpec([None, 3, None]),
                                                   tf.TensorSpec([], tf.int32)],
                           jit_compile=mode == "jit")
    for start in (0, 1, 2):
        y = rows(x, tf.constant(start))
        np.testing.assert_array_equal(y.numpy(), x.numpy()[start:start + 2])


def test_block_rows_default_and_override():
    assert _flash.block_rows(512, 512) == 128
    assert _flash.block_rows(2048, 2048) == 128  # key blocks of 512 beyond 1024 keys
    assert _flash.key_block(2048) == 512 and _flash.key_block(1024) is None
    assert _flash.block_rows(6, 6) == 6  # short sequences: one block
    assert _flash.block_rows(100000, 100000) == 128
    with recompute.attention_block_size(4):
        assert _flash.block_rows(512, 512) == 4
        with recompute.attention_block_size(None):
            assert _flash.block_rows(512, 512) == 128
        assert _flash.block_rows(3, 512) == 3
    assert _flash.block_rows(512, 512) == 128
    # one object, two blocks: set at each entry; restored to what each entry found
    four = recompute.attention_block_size(4)
    recompute.attention_block_size(None)
    for _ in range(2):
        with four:
            assert _flash.block_rows(512, 512) == 4
        assert _flash.block_rows(512, 512) == 128
    # made earlier, entered after a later statement: exit keeps the statement's size
    eight = recompute.attention_block_size(8)
    recompute.attention_block_size(16)
    with eight:
        assert _flash.block_rows(512, 512) == 8
    assert _flash.block_rows(512, 512) == 16
    recompute.attention_block_size(None)
    assert repr(eight) == "attention_block_size(8)"
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"`rows` must be an integer >= 1 or None\. Received: rows="):
            recompute.attention_block_size(bad)


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("keys", [12, 9, 1000])
def test_keras3_tf_decision_is_the_dropout_layers_own(mode, keys, monkeypatch):
    """On Keras 3's TensorFlow backend the blocked core draws the dropout's decision in
    chunks of rows (`_flash_tf.stateless_keep_bits`: no whole uniform tensor): the very
    mask `keras.layers.Dropout` draws from the same state -- over several chunks, a last
    partial one, keys not a multiple of 8 -- and the same state after, in eager mode,
    `tf.function` and XLA."""
    import keras
    import tensorflow as tf

    from recompute.ops import _flash_tf

    monkeypatch.setattr(_flash_tf, "DRAW_ELEMENTS", 96)  # several chunks here
    dropout = keras.layers.Dropout(0.3, seed=5)
    batch_like = tf.zeros([2, 1])
    shape = [3, 7, keys]

    def ours():
        bits = _flash_tf.dropout_bits(dropout, batch_like, shape, "float32", None)
        return _flash_tf.ENGINE.unpack(bits, keys)

    def own():
        return dropout(tf.ones([2] + shape), training=True) != 0

    if mode != "eager":
        ours, own = (tf.function(f, jit_compile=mode == "jit") for f in (ours, own))
    start = np.asarray(dropout.seed_generator.state.value)
    keep = ours().numpy()
    after = np.asarray(dropout.seed_generator.state.value)
    dropout.seed_generator.state.assign(start)
    np.testing.assert_array_equal(keep, own().numpy())
    np.testing.assert_array_equal(after, np.asarray(dropout.seed_generator.state.value))
    assert 0.5 < keep.mean() < 0.9
    # Not for another dropout (a noise shape) or dtype.
    noisy = keras.layers.Dropout(0.3, noise_shape=(1,))
    assert _flash_tf.dropout_bits(noisy, batch_like, shape, "float32", None) is None
    assert _flash_tf.dropout_bits(dropout, batch_like, shape, "float16", None) is None


def test_attention_core_setting_and_its_docstring_example():
    """`recompute.attention_core`: a statement or a context manager (restored on exit to what the
    entry found), a clear error for another value; the docstring's example runs (a `fit`
    under `attention_core("keras")`), and the rule follows it on TensorFlow."""
    import keras

    from recompute.ops import _flash, _flash_tf

    assert _flash.runs_blocked(_flash_tf.ENGINE, "float32", 2048, 2048)  # "auto" on TensorFlow
    with recompute.attention_core("keras"):
        assert not _flash.runs_blocked(_flash_tf.ENGINE, "float32", 2048, 2048)
        inputs = keras.Input((6, 8))
        block = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
        model = keras.Model(inputs, block(inputs, inputs))
        model.call = recompute.recompute_grad(model.call)
        model.compile("sgd", "mse")
        with recompute.recompute_scope(True):
            model.fit(np.ones((4, 6, 8), "float32"), np.zeros((4, 6, 8), "float32"), epochs=1,
                      verbose=0)
    assert _flash.runs_blocked(_flash_tf.ENGINE, "float32", 2048, 2048)
    assert not _flash.runs_blocked(_flash_tf.ENGINE, "bfloat16", 2048, 2048)  # half precision
    with recompute.attention_core("blocked"):
        assert _flash.runs_blocked(_flash_tf.ENGINE, "float32", 12, 12)
        assert not _flash.runs_blocked(_flash_tf.ENGINE, "float16", 12, 12)
    assert repr(recompute.attention_core("auto")) == "attention_core('auto')"
    with pytest.raises(ValueError, match=r'`core` must be one of "auto", "blocked", "keras"\. '
                                         r"Received: core='flash'"):
        recompute.attention_core("flash")


def test_tensorflow_rule_by_key_length():
    """Under "auto" on TensorFlow, float32 and float64: the layer's own core up to
    `_flash.TF_KERAS_CORE_KEYS` (512) keys, the blocked core beyond; a key length known only
    when the core runs (None): the layer's own core. The override and half precision win
    over the shape."""
    from recompute.ops import _flash, _flash_tf

    tf_engine = _flash_tf.ENGINE
    assert _flash.TF_KERAS_CORE_KEYS == 512
    for queries, keys, blocked in [(6, 6, False), (512, 512, False), (513, 513, True),
                                   (1024, 1024, True), (2048, 2048, True), (1, 4096, True),
                                   (4096, 512, False), (None, None, False), (2048, None, False),
                                   (None, 2048, True)]:
        assert _flash.runs_blocked(tf_engine, "float32", queries, keys) is blocked, (queries, keys)
        assert _flash.runs_blocked(tf_engine, "float64", queries, keys) is blocked, (queries, keys)
        assert not _flash.runs_blocked(tf_engine, "float16", queries, keys)
        with recompute.attention_core("blocked"):
            assert _flash.runs_blocked(tf_engine, "float32", queries, keys)
        with recompute.attention_core("keras"):
            assert not _flash.runs_blocked(tf_engine, "float32", queries, keys)
            assert not _flash.runs_blocked(tf_engine, "float32", queries, keys, "attention")


def test_tensorflow_rule_under_the_attention_policy():
    """Under "auto" on TensorFlow with `policy="attention"`, the blocked core up to 512 keys
    too, as one block of every query row (`block_rows`), where both lengths are known;
    under "full" (and no policy) the rule of `test_tensorflow_rule_by_key_length`; on JAX,
    and with `attention_block_size` set, the rows as before."""
    from recompute.ops import _flash, _flash_jax, _flash_tf

    tf_engine, jax_engine = _flash_tf.ENGINE, _flash_jax.ENGINE
    for queries, keys, blocked in [(6, 6, True), (512, 512, True), (4096, 512, True),
                                   (513, 513, True), (None, None, False), (2048, None, False),
                                   (None, 512, False)]:
        assert _flash.runs_blocked(tf_engine, "float32", queries, keys, "attention") is blocked
        assert not _flash.runs_blocked(tf_engine, "float16", queries, keys, "attention")
    for policy in (None, "full"):
        assert not _flash.runs_blocked(tf_engine, "float32", 512, 512, policy)
        assert _flash.block_rows(512, 512, tf_engine, policy) == 128
    assert _flash.block_rows(512, 512, tf_engine, "attention") == 512
    assert _flash.block_rows(6, 6, tf_engine, "attention") == 6
    assert _flash.block_rows(1024, 1024, tf_engine, "attention") == _flash.block_rows(1024, 1024)
    assert _flash.block_rows(512, 512, jax_engine, "attention") == 128
    with recompute.attention_block_size(64):
        assert _flash.block_rows(512, 512, tf_engine, "attention") == 64
