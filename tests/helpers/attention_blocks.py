"""A standard transformer block (MultiHeadAttention, GELU FFN, LayerNorm, dropout) for
the policy tests of both Keras families: `K` is `keras` or `tf_keras`.

`run(K, policy, on, mode, block)` trains the same seeded model one step with
padding and dropout on, and returns the loss, every gradient (input included),
how often each block and attention core ran, and the step's graph (modes
"function"/"jit") for the memory checks. `block` is the blocked attention
core's query rows per block (`recompute.attention_block_size`): None (the
default: one block at this length), 4 (two blocks, the last one padded), 1.
`core` is the attention core (`recompute.attention_core`): "blocked" by default,
named, since at seq 6 the rule ("auto") runs Keras's own core on TensorFlow.

The `test_*` functions are the policy tests of both suites, written once: each
suite's test_recompute_policies*.py imports them (`__all__`) with its fixture `K`.
"""

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import to_numpy

SEQ, WIDTH, HEADS, BATCH = 6, 16, 2, 3
COUNTS = {"block": 0, "core": 0}


def block_class(K, policy):
    """A block class whose `call` is decorated with `policy` (None: undecorated)."""

    class CountingAttention(K.layers.MultiHeadAttention):
        # Counted in the masked softmax, which Keras's core and the blocked core
        # (recompute.ops._attention, once per block) both call: the core class stays Keras's own.
        def _masked_softmax(self, *args, **kwargs):
            COUNTS["core"] += 1
            return super()._masked_softmax(*args, **kwargs)

    class AttentionBlock(K.layers.Layer):
        def __init__(self, rate=0.2, **kwargs):
            super().__init__(**kwargs)
            self.attention = CountingAttention(HEADS, WIDTH // HEADS, dropout=rate)
            self.drop1 = K.layers.Dropout(rate)
            self.norm1 = K.layers.LayerNormalization()
            self.ffn1 = K.layers.Dense(2 * WIDTH, activation="gelu")
            self.ffn2 = K.layers.Dense(WIDTH)
            self.drop2 = K.layers.Dropout(rate)
            self.norm2 = K.layers.LayerNormalization()

        def call(self, x, mask, training=None):
            COUNTS["block"] += 1
            a = self.attention(x, x, attention_mask=mask, training=training)
            x = self.norm1(x + self.drop1(a, training=training))
            h = self.ffn2(self.ffn1(x))
            return self.norm2(x + self.drop2(h, training=training))

    if policy is not None:
        AttentionBlock.call = recompute_grad(AttentionBlock.call, policy=policy)
    return AttentionBlock


def build_model(K, policy, depth=2, seed=0):
    K.utils.set_random_seed(seed)
    cls = block_class(K, policy)
    x = K.Input((SEQ, WIDTH))
    mask = K.Input((SEQ, SEQ), dtype="bool")
    h = x
    for _ in range(depth):
        h = cls()(h, mask)
    y = K.layers.Dense(1)(K.layers.GlobalAveragePooling1D()(h))
    return K.Model([x, mask], y)


def inputs():
    x = tf.random.stateless_normal([BATCH, SEQ, WIDTH], seed=(3, 4))
    lengths = tf.constant([SEQ, SEQ - 2, 2])  # padding in two of the three rows
    keys = tf.sequence_mask(lengths, SEQ)
    mask = tf.logical_and(keys[:, None, :], keys[:, :, None])
    return x, mask


def _loss(model, x, mask):
    y = model([x, mask], training=True)
    return tf.reduce_mean((y - 0.5) ** 2)


def run(K, policy, on, mode, block=None, core="blocked"):
    """(loss, gradients, counts, graph) of one step; `mode` in eager/function/jit."""
    with recompute.attention_block_size(block), recompute.attention_core(core):
        return _run(K, policy, on, mode)


def _run(K, policy, on, mode):
    model = build_model(K, policy)
    x, mask = inputs()
    model([x, mask])  # built outside the recomputation

    def step(x, mask):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _loss(model, x, mask)
        return loss, tape.gradient(loss, [x] + model.trainable_variables)

    graph = None
    COUNTS.update(block=0, core=0)
    with recompute.recompute_scope(on):
        if mode != "eager":  # the trace counts the Python calls (the backward pass's included)
            step = tf.function(step, jit_compile=mode == "jit")
            graph = step.get_concrete_function(x, mask).graph
            counts = dict(COUNTS)
        loss, grads = step(x, mask)
    if mode == "eager":
        counts = dict(COUNTS)
    return float(loss), to_numpy(grads), counts, graph, model


def fit_weights(K, policy, on, epochs=2, core="blocked"):
    """The weights after `fit` (shuffle off, dropout on, padding)."""
    model = build_model(K, policy)
    x, mask = inputs()
    y = tf.reshape(tf.range(BATCH, dtype=tf.float32), [BATCH, 1])
    model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
    with recompute.recompute_scope(on), recompute.attention_core(core):
        model.fit([x, mask], y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def forward_tensors_read_by_backward(graph):
    """The tensors of the forward pass that ops of the backward pass read.

    The backward pass starts at the first op under "gradient_tape/"; an op
    created before it is a forward op.
    """
    ops = graph.get_operations()
    first = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
    forward = set(op.name for op in ops[:first])
    return [t for op in ops[first:] for t in op.inputs if t.op.name in forward]


def forward_tensors_kept(graph, rank4_last_dims=(SEQ, SEQ)):
    """The types of the forward ops whose float [.., SEQ, SEQ] outputs the backward pass reads."""
    return {t.op.type for t in forward_tensors_read_by_backward(graph)
            if t.shape.rank is not None and t.shape.rank >= 3
            and tuple(t.shape[-2:]) == rank4_last_dims and t.dtype.is_floating}


def ancestors(op):
    """The names of `op` and of every op it depends on (inputs and control inputs)."""
    seen, stack = set(), [op]
    while stack:
        o = stack.pop()
        if o.name in seen:
            continue
        seen.add(o.name)
        stack.extend(t.op for t in o.inputs)
        stack.extend(o.control_inputs)
    return seen


def check_mask_kept_as_bits(graph, seq=SEQ):
    """The dropout decision crosses from the forward to the backward pass as bits
    (uint8 [batch, heads, seq, ceil(seq / 8)], `recompute.ops._flash_tf.pack`), no bool
    [.., seq, seq] mask; the forward pass unpacks it, and so does the backward pass,
    once the gradient has arrived (`_core.after`)."""
    import tensorflow as tf

    read = forward_tensors_read_by_backward(graph)
    masks = [t.name for t in read if t.dtype == tf.bool and t.shape.rank is not None
             and t.shape.rank >= 3 and tuple(t.shape[-2:]) == (seq, seq)
             and not _is_input(t)]  # (the attention mask passed in is an input)
    assert not masks, masks
    assert any(t.dtype == tf.uint8 and t.shape.rank == 4 and t.shape[-1] == -(-seq // 8)
               for t in read), [t.name for t in read]
    unpacks = [op for op in graph.get_operations() if _unpacks(op)]
    waiting = [op.name for op in unpacks
               if any(name.startswith("gradient_tape/") for name in ancestors(op))]
    assert waiting and len(waiting) < len(unpacks), (waiting, [op.name for op in unpacks])


def _unpacks(op):
    """Whether `op` unpacks bits (`recompute.ops._flash_tf`'s unpacking): words of 8 bytes
    read as bytes, or (shapes not fully known) a byte shifted."""
    import tensorflow as tf

    if op.type == "Bitcast":
        return op.inputs[0].dtype == tf.uint64 and op.outputs[0].dtype == tf.uint8
    return op.type == "RightShift" and op.outputs[0].dtype == tf.uint8


def _is_input(t):
    """Whether `t` is an input of the step, or a view of one (a new axis, a reshape)."""
    while t.op.type in ("StridedSlice", "ExpandDims", "Reshape", "Identity"):
        t = t.op.inputs[0]
    return t.op.type == "Placeholder"


def _ops_with_bodies(graph, ops):
    """`ops` and the ops of the loop bodies and branches they run, recursively."""
    found = []
    stack = list(ops)
    while stack:
        op = stack.pop()
        found.append(op)
        for attr in ("body", "cond", "then_branch", "else_branch", "f"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            fn = graph._get_function(name)
            if fn is not None and hasattr(fn, "graph"):
                stack.extend(fn.graph.get_operations())
    return found


def attention_matrices_in_backward(graph, seq=SEQ):
    """The float tensors of the backward pass (loop bodies included) that hold every
    query row against every key: [.., rows >= seq, seq]."""
    ops = graph.get_operations()
    first = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
    # What the function runs: the ancestors of its outputs (TensorFlow prunes the rest,
    # e.g. tf_keras's attention scores, computed beside the blocked core and unused).
    live = set()
    for t in list(graph.outputs) + [op.outputs[0] for op in graph.control_outputs if op.outputs]:
        live |= ancestors(t.op)
    found = set()
    backward = [op for op in ops[first:] if op.name in live]
    for op in _ops_with_bodies(graph, backward):
        for t in op.outputs:
            if (t.dtype.is_floating and t.shape.rank is not None and t.shape.rank >= 3
                    and t.shape[-1] == seq and t.shape[-2] is not None and t.shape[-2] >= seq):
                found.add(f"{op.type}:{tuple(t.shape)}")
    return found


# The tests both suites run (tests/recompute_*/test_recompute_policies*.py import them
# with the fixture `K` of tests/helpers/families.py).


# Blocks of 1 row (slow) eagerly only: traced (function, XLA) they run the loop that blocks
# of 4 run (at seq 6: a block of 4 rows and one of 2), 6 times instead of twice, for half a
# minute more each.
@pytest.mark.fast
@pytest.mark.parametrize("policy", ["full", "attention"])
@pytest.mark.parametrize("block, mode", [
    *((block, mode) for block in (None, 4) for mode in ("eager", "function", "jit")),
    pytest.param(1, "eager", marks=pytest.mark.slow)])
def test_policy_matches_no_recompute(K, policy, mode, block):
    """`policy` with RECOMPUTE on: the loss and every gradient of the undecorated
    block to float rounding (the attention cores run blocked); "full" runs each
    block twice, "attention" once."""
    from tests.helpers.numerics import assert_all_close

    loss0, grads0, counts0, _, model = run(K, None, False, mode)
    loss1, grads1, counts1, _, _ = run(K, policy, True, mode, block)
    names = ["input"] + [getattr(v, "path", v.name) for v in model.trainable_variables]
    assert_all_close([loss0], [loss1], ["loss"])
    assert_all_close(grads0, grads1, names)
    assert counts0 == {"block": 2, "core": 2}
    assert counts1["block"] == (4 if policy == "full" else 2)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_blocked_cores_used(K, policy, monkeypatch):
    """Under either policy, with `attention_core("blocked")` Keras's own cores run blocked
    (`recompute.ops._flash`): once per forward pass of a block (twice per block under "full",
    which recomputes the block) and once backward; off, never. Under the rule ("auto")
    at seq 6 on TensorFlow (`_flash.runs_blocked`: up to 512 keys) Keras's own core runs
    under "full", the blocked core as one block of every row under "attention"."""
    from recompute.ops import _flash

    calls = []
    for name in ("forward", "backward"):
        real = getattr(_flash, name)
        monkeypatch.setattr(_flash, name,
                            lambda *a, _name=name, _real=real, **k: calls.append(_name) or _real(*a, **k))
    run(K, policy, True, "eager")
    forwards = 4 if policy == "full" else 2  # 2 blocks
    assert sorted(calls) == ["backward"] * 2 + ["forward"] * forwards
    calls.clear()
    run(K, policy, False, "eager")
    assert calls == []
    rows = []
    real_rows = _flash.block_rows
    monkeypatch.setattr(_flash, "block_rows",
                        lambda *a, **k: rows.append(real_rows(*a, **k)) or rows[-1])
    run(K, policy, True, "eager", core="auto")
    if policy == "full":
        assert calls == [] and rows == []
    else:
        assert sorted(calls) == ["backward"] * 2 + ["forward"] * 2
        assert rows and set(rows) == {SEQ}  # one block of every query row


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_backward_holds_no_attention_matrix(K, policy):
    """With blocks of 4 rows at seq 6, no float tensor of the backward pass -- the
    recomputation of "full" included, and the loops' bodies -- holds every query
    row: one block at a time. Without recomputation the backward pass holds them."""
    assert attention_matrices_in_backward(run(K, None, False, "function")[3])
    graph = run(K, policy, True, "function", block=4)[3]
    assert not attention_matrices_in_backward(graph)
    assert not forward_tensors_kept(graph)


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_gelus_keep_their_input(K, policy, monkeypatch):
    """The blocks' exact GELUs run as `recompute.ops._gelu.keeping_input` under "attention"
    (recomputation on), and their shadowing is undone after the call; "full"
    recomputes them as written (with it, Adam turned rounding-level differences of
    analytically zero gradients into whole steps in `examples/recompute_fit.py`)."""
    from recompute.ops import _gelu

    calls = []
    real = _gelu.keeping_input
    monkeypatch.setattr(_gelu, "keeping_input", lambda fn: calls.append(fn) or real(fn))
    model = run(K, policy, True, "eager")[4]
    assert len(calls) == (0 if policy == "full" else 2)  # 2 blocks
    assert all(_gelu.is_exact_gelu(fn) for fn in calls)
    dense = [block.ffn1 for block in model.layers if hasattr(block, "ffn1")]
    assert len(dense) == 2 and all(_gelu.is_exact_gelu(lyr.activation) for lyr in dense)  # restored
    calls.clear()
    run(K, policy, False, "eager")
    assert calls == []


def test_attention_policy_keeps_only_the_gelu_input(K):
    """Under "attention" the backward pass reads one [.., ffn] tensor of each block's
    forward pass: the GELU's input (`recompute.ops._lean.lean_layers`: the second
    `Dense` does not keep the GELU's output, nor the GELU its intermediates); without
    recomputation it reads four (three of the GELU's intermediates, and its output as
    the second `Dense`'s product reads it)."""

    def wide(graph):  # float tensors of the FFN's width, not the kernels
        return {t.name for t in forward_tensors_read_by_backward(graph)
                if t.dtype.is_floating and t.shape.rank and t.shape[-1] == 2 * WIDTH
                and t.op.type != "ReadVariableOp"}

    assert len(wide(run(K, None, False, "function")[3])) == 2 * 4  # 2 blocks
    kept = wide(run(K, "attention", True, "function")[3])
    assert len(kept) == 2, kept


def test_attention_policy_layer_norms_keep_their_input(K):
    """Under "attention" the backward pass reads no per-sample tensor computed inside a
    block's LayerNormalization, its output included (`recompute.ops._layer_norm`, `_lean`:
    the gradient from the input alone; the first block's output, the second block's input,
    made again from the LayerNorm's kept input for the query, key and value projections'
    kernels); without recomputation it reads the normalization's intermediates and its
    outputs."""

    def inside(graph):  # per-sample tensors (rank >= 2)
        return {t.op.type for t in forward_tensors_read_by_backward(graph)
                if "layer_normalization" in t.op.name and t.shape.rank and t.shape.rank >= 2}

    assert inside(run(K, None, False, "function")[3]) - {"IdentityN"}
    assert inside(run(K, "attention", True, "function")[3]) == set()


@pytest.mark.parametrize("center,scale,axis", [(True, True, -1), (False, True, -1),
                                               (True, False, -1), (True, True, 1)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_layer_norm_keeping_input_matches_the_layer(K, center, scale, axis, mode, monkeypatch):
    """`recompute.ops._lean.lean_layers` on a LayerNormalization: its output and the gradients
    of its input, gamma and beta equal the layer's own to float rounding (float32 and
    float64; not over the last axis: the layer's own call, the same numbers exactly)."""
    from recompute.adapters import _keras3, _tf_keras
    from recompute.ops import _layer_norm, _lean
    from tests.helpers.numerics import assert_all_close

    tf_variable = _tf_keras.tf_variable if K.__name__ == "tf_keras" else _keras3.tf_variable
    calls = []
    real = _layer_norm.keeping_input
    monkeypatch.setattr(_layer_norm, "keeping_input", lambda *a: calls.append(1) or real(*a))
    for dtype in ("float32", "float64"):
        layer = K.layers.LayerNormalization(axis=axis, center=center, scale=scale, dtype=dtype)
        x = tf.cast(tf.random.stateless_normal([BATCH, SEQ, WIDTH], seed=(5, 6)) * 3 + 1, dtype)
        layer(x)
        if scale:
            layer.gamma.assign(tf.cast(tf.linspace(0.5, 2.0, layer.gamma.shape[0]), dtype))
        weights = [w for w in (layer.gamma, layer.beta) if w is not None]

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(y * tf.cos(tf.cast(tf.range(WIDTH), dtype)))
            return [y] + tape.gradient(loss, [x] + weights)

        traced = (lambda: tf.function(step)) if mode == "function" else (lambda: step)
        expected = to_numpy(traced()(x))
        with _lean.lean_layers([layer], tf_variable):
            got = to_numpy(traced()(x))
        names = ["y", "x"] + [w.name for w in weights]
        if axis == 1:
            for a, b in zip(expected, got):
                np.testing.assert_array_equal(a, b)
        else:
            assert_all_close(expected, got, names)
        assert "call" not in vars(layer)  # restored
    assert (len(calls) > 0) == (axis == -1)


@pytest.mark.parametrize("equation,bias,shape", [("abc,cde->abde", "de", (HEADS, WIDTH // HEADS)),
                                                 ("abc,cd->abd", "d", (WIDTH,)),
                                                 ("abc,cd->abd", None, (WIDTH,)),
                                                 ("...b,bc->...c", "c", (WIDTH,))])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_einsum_dense_remaking_its_input_matches_the_layer(K, equation, bias, shape, mode,
                                                          monkeypatch):
    """`recompute.ops._lean.lean_layers` on a LayerNormalization feeding two `EinsumDense`
    layers (a block's output feeding the next block's query and key projections): each
    projection makes the LayerNorm's output again for its kernel's gradient
    (`_lean.einsum_recomputing_input`), the two sharing one remade output (the norm runs
    once more, for both gradients); the outputs and every gradient equal the
    layers' own to float rounding. An equation with an ellipsis runs as written."""
    from recompute.adapters import _keras3, _tf_keras
    from recompute.ops import _lean
    from tests.helpers.numerics import assert_all_close

    tf_variable = _tf_keras.tf_variable if K.__name__ == "tf_keras" else _keras3.tf_variable
    calls, norms = [], []
    real = _lean.einsum_recomputing_input
    monkeypatch.setattr(_lean, "einsum_recomputing_input",
                        lambda *a: calls.append(1) or real(*a))
    remade_after = _lean.remade_after
    monkeypatch.setattr(_lean, "remade_after", lambda call, x: remade_after(
        lambda v: norms.append(1) or call(v), x))
    norm = K.layers.LayerNormalization()
    denses = [K.layers.EinsumDense(equation, output_shape=(SEQ,) + shape, bias_axes=bias)
              for _ in range(2)]
    x = tf.random.stateless_normal([BATCH, SEQ, WIDTH], seed=(7, 8)) * 2 + 1
    for dense in denses:
        dense(norm(x))
    weights = [norm.gamma, norm.beta] + [w for d in denses for w in d.trainable_weights]

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            n = norm(x)
            ys = [dense(n) for dense in denses]
            loss = tf.reduce_sum(tf.sin(ys[0]) * tf.cos(ys[1]))
        return ys + tape.gradient(loss, [x] + weights)

    traced = (lambda: tf.function(step)) if mode == "function" else (lambda: step)
    expected = to_numpy(traced()(x))
    with _lean.lean_layers([norm] + denses, tf_variable):
        got = to_numpy(traced()(x))
    assert_all_close(expected, got, ["y0", "y1", "x"] + [w.name for w in weights])
    remade = "..." not in equation
    assert len(calls) == (2 if remade else 0)
    assert len(norms) == (1 if remade else 0)  # made again once
    assert all("call" not in vars(dense) for dense in denses)  # restored


@pytest.mark.parametrize("flow", ["while", "cond"])
@pytest.mark.parametrize("kind", ["EinsumDense", "Dense"])
def test_lean_layers_in_control_flow_match_the_layers(K, flow, kind):
    """A LayerNorm feeding a projection inside a `tf.while_loop` body or a `tf.cond` branch
    under `recompute.ops._lean.lean_layers`: the gradient of a branch or body cannot capture
    the LayerNorm's weights where the forward pass did not read them, so the projection keeps
    its input there (`recompute.adapters._tf.in_control_flow_body`); every gradient equals
    the layers' own. (It raised in the gradient before.)"""
    from recompute.adapters import _keras3, _tf_keras
    from recompute.ops import _lean
    from tests.helpers.numerics import assert_all_close

    tf_variable = _tf_keras.tf_variable if K.__name__ == "tf_keras" else _keras3.tf_variable
    norm = K.layers.LayerNormalization()
    proj = (K.layers.EinsumDense("abc,cd->abd", (SEQ, WIDTH)) if kind == "EinsumDense"
            else K.layers.Dense(WIDTH))
    x = tf.random.stateless_normal([BATCH, SEQ, WIDTH], seed=(9, 10))
    proj(norm(x))
    weights = [norm.gamma, norm.beta] + list(proj.trainable_weights)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if flow == "while":
                _, h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, proj(norm(h))),
                                     (tf.constant(0), x))
            else:
                h = tf.cond(tf.reduce_sum(x) > -1e9, lambda: proj(norm(x)), lambda: x)
            loss = tf.reduce_sum(tf.sin(h))
        return tape.gradient(loss, [x] + weights)

    expected = to_numpy(tf.function(step)(x))
    with _lean.lean_layers([norm, proj], tf_variable):
        got = to_numpy(tf.function(step)(x))
    assert_all_close(expected, got, ["x"] + [w.name for w in weights])


def test_attention_policy_recomputation_draws_no_random_numbers(K):
    """Under "attention" the backward pass draws no random numbers (the dropout's
    decision is kept as bits) and reads one uint8 tensor of bits per core; under
    "full" it draws the other dropouts' masks again (replayed), not the cores'."""

    def backward_ops(graph):
        ops = graph.get_operations()
        first = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape/"))
        return ops[first:]

    def draws(graph):
        return [op for op in backward_ops(graph) if "Random" in op.type]

    graph = run(K, "attention", True, "function")[3]
    assert draws(graph) == []
    masks = {t.name for t in forward_tensors_read_by_backward(graph)
             if t.dtype == tf.uint8 and t.shape.rank == 4}
    assert len(masks) == 2, masks  # 2 blocks
    redrawn = draws(run(K, "full", True, "function")[3])
    assert redrawn  # the blocks' two Dropout layers
    assert not any(tuple(t.shape[-2:]) == (SEQ, SEQ) for op in redrawn for t in op.outputs
                   if t.shape.rank), [op.name for op in redrawn]


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_fit_matches(K, policy):
    from tests.helpers.numerics import assert_all_close

    assert_all_close(fit_weights(K, None, False), fit_weights(K, policy, True))


def dropout_masks_read_by_backward(graph):
    """`{(dtype name, shape): count}` of the rank-3 bool and uint8 tensors of the forward
    pass that the backward pass reads: a hidden dropout's decision, as bools or bits."""
    found = {}
    for t in forward_tensors_read_by_backward(graph):
        if t.shape.rank == 3 and t.dtype in (tf.bool, tf.uint8):
            found.setdefault((t.dtype.name, tuple(t.shape)), set()).add(t.name)
    return {key: len(names) for key, names in found.items()}


def test_attention_policy_keeps_dropout_bits(K):
    """Under "attention" the block's own `Dropout` layers keep their decisions as bits
    (`recompute.ops._lean.keeping_bits`): the backward pass reads uint8 [batch, seq,
    width / 8], one per dropout, and no bool [batch, seq, width]; without recomputation
    it reads the bools."""
    masks = dropout_masks_read_by_backward
    assert masks(run(K, "attention", True, "function")[3]) == {
        ("uint8", (BATCH, SEQ, WIDTH // 8)): 4}  # 2 blocks, 2 dropouts each
    assert masks(run(K, None, False, "function")[3]) == {("bool", (BATCH, SEQ, WIDTH)): 4}


def _small_thresholds(monkeypatch):
    """The blocked core one sample at a time (`_flash_tf.SAMPLE_ELEMENTS`) and the GELU
    product's gradient in chunks of 3 rows (`_gelu.CHUNK_ELEMENTS`: half a sequence),
    at these small widths; returns the lists the counted calls append to: the batch of
    each `_flash.backward` call, the rows of each `_gelu.with_erfc` call."""
    from recompute.ops import _flash, _flash_tf, _gelu

    monkeypatch.setattr(_flash_tf, "SAMPLE_ELEMENTS", 1)
    monkeypatch.setattr(_gelu, "CHUNK_ELEMENTS", 3 * 2 * WIDTH)  # the GELU is 2 * WIDTH wide
    backward, with_erfc = _flash.backward, _gelu.with_erfc
    samples, rows = [], []
    monkeypatch.setattr(_flash, "backward",
                        lambda *a, **k: samples.append(a[2].shape[0]) or backward(*a, **k))
    monkeypatch.setattr(_gelu, "with_erfc", lambda h: rows.append(h.shape[0]) or with_erfc(h))
    return samples, rows


def _matches_no_recompute(K, policy, mode, core):
    """One step under `policy` (RECOMPUTE on, `attention_core(core)`): the loss and every
    gradient RECOMPUTE=0's to float rounding."""
    from tests.helpers.numerics import assert_all_close

    loss0, grads0, _, _, model = run(K, None, False, mode)
    loss1, grads1, _, _, _ = run(K, policy, True, mode, core=core)
    names = ["input"] + [getattr(v, "path", v.name) for v in model.trainable_variables]
    assert_all_close([loss0], [loss1], ["loss"])
    assert_all_close(grads0, grads1, names)


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_attention_policy_by_sample_and_row_chunks(K, mode, monkeypatch):
    """Under the rule ("auto"), "attention" on TensorFlow runs the blocked core one
    sample at a time where a sample's tile is large, and the gradient of the product the
    GELU feeds in chunks of rows: with both thresholds lowered to these widths the loss
    and every gradient are RECOMPUTE=0's to float rounding; in eager mode the core's
    backward pass runs once per sample and block, the GELU's gradient once per chunk."""
    samples, rows = _small_thresholds(monkeypatch)
    _matches_no_recompute(K, "attention", mode, "auto")
    if mode == "eager":
        assert samples == [1] * (2 * BATCH)  # 2 blocks
        assert rows == [3] * 12  # 2 blocks of 18 rows
    else:
        assert samples and set(samples) == {1}


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_full_policy_blocked_core_by_sample(K, mode, monkeypatch):
    """The loop over samples runs wherever the blocked core runs with one key block: under
    "full" too (here forced, `attention_core("blocked")`), the loss and every gradient
    RECOMPUTE=0's; in eager mode one backward pass per sample and block."""
    samples, _ = _small_thresholds(monkeypatch)
    _matches_no_recompute(K, "full", mode, "blocked")
    if mode == "eager":
        assert samples == [1] * (2 * BATCH)


def test_attention_policy_by_sample_fit(K, monkeypatch):
    """The same in `fit` (its batch axis of unknown length in the traced step)."""
    from tests.helpers.numerics import assert_all_close

    samples, _ = _small_thresholds(monkeypatch)
    assert_all_close(fit_weights(K, None, False), fit_weights(K, "attention", True, core="auto"))
    assert samples and set(samples) == {1}


def test_attention_policy_keeps_no_attention_matrix(K):
    """The backward pass reads no [.., seq, seq] tensor of the forward pass (softmax,
    dropout and scores are recomputed); without recomputation it reads the softmax."""
    kept_off = forward_tensors_kept(run(K, None, False, "function")[3])
    kept_on = forward_tensors_kept(run(K, "attention", True, "function")[3])
    assert "Softmax" in kept_off, kept_off
    assert not kept_on, kept_on
    check_mask_kept_as_bits(run(K, "attention", True, "function")[3])


def check_attention_policy_needs_attention_layers(K, on):
    """policy="attention" on a block without `MultiHeadAttention` is refused at its first
    call, RECOMPUTE on or off, tape or not, with the same error in every family (`K`:
    keras on either backend, or tf_keras); a block that has one is accepted either way."""

    class NoAttention(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = K.layers.Dense(2)

        @recompute_grad(policy="attention")
        def call(self, x):
            return self.dense(x)

    family = "tf_keras" if K.__name__ == "tf_keras" else "Keras 3"
    message = (
        r"`recompute_grad\(policy='attention'\)` recomputes the attention core of the "
        rf"`MultiHeadAttention` layers \({family}\) that the decorated layer contains\. "
        r"Received: layer 'no_attention', which contains none\. Create them in `__init__` "
        r"or `build` \(as attributes of the layer\), or use policy='full'\."
    )
    layer = NoAttention(name="no_attention")
    x = np.ones([1, 2], "float32")
    with recompute.recompute_scope(on):
        with pytest.raises(ValueError, match=message):
            layer(x)
        with tf.GradientTape(), pytest.raises(ValueError, match=message):
            layer(x)
        block = block_class(K, "attention")()
        x, mask = (np.asarray(t) for t in inputs())
        with tf.GradientTape():
            block(x, mask)


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_attention_policy_without_attention_layer_is_refused(K, on):
    check_attention_policy_needs_attention_layers(K, on)


__all__ = [name for name in dir() if name.startswith("test_")]  # what the suites import
