"""Blocked attention: an attention core that never holds [seq, seq] floats beyond one block.

FlashAttention's idea (Dao et al., 2022) written in framework ops, once, for
both engines (`_flash_tf` for TensorFlow, `_flash_jax` for JAX: each an
`Engine` below). The core computes, per head,

    P = masked_softmax(scale * Q K^T),    O = drop(P) V

where `drop` is the layer's dropout, its decision drawn once, by the layer's
own dropout op (so the masks are those of RECOMPUTE=0), and held as bits (1 bit
per entry, packed along the key axis). The query axis is cut into blocks of
`block` rows:

- forward: block by block, `P_j = probabilities(Q_j, K)` (the layer's own
  scores, mask and softmax over all keys: no running maximum is needed when a
  block spans every key), `O_j = drop(P_j) V`; only O is kept, and the inputs.
- backward (the gradient `dO` arrives): block by block, `P_j` again, then
  `dV += drop(P_j)^T dO_j`, `dP_j = drop'(dO_j V^T)` (the dropout is linear:
  its gradient is the same selection and scaling), and the vector-Jacobian
  product of `probabilities` at `(Q_j, K)` with `dP_j` gives `dQ_j` and adds
  to `dK` -- the softmax's gradient `P ∘ (dP - rowsum(dP ∘ P))` and the
  mask's, as autodiff takes them for the layer's own ops.

One block's [batch, heads, block, seq] tensors are alive at a time (a loop of
the engine's: `tf.while_loop`, `jax.lax.fori_loop`), in the forward pass and in the
backward pass. The blocks' results equal the unblocked core's to float
rounding (the sums over keys are the same; dK and dV add the blocks' parts).

Block size: `block_rows(queries, keys)`, by default the rows that make a block
of at most `DEFAULT_BLOCK_ELEMENTS` (query, key) pairs; `attention_block_size`
overrides it.

Besides its `ENGINE`, each engine module gives `_attention` the same four
functions: `attention(...)` (the core with its gradient), `pack(mask)` (bits),
`ones(batch_like, shape, dtype)` and `dropout_bits(dropout, batch_like, shape,
dtype, rows)` (the decision of Keras 3's `Dropout` drawn without the whole
uniform tensor, or None where the engine cannot).
"""

from ._setting import Setting

DEFAULT_BLOCK_ELEMENTS = 64 * 1024  # rows x keys of one block: 128 rows at seq 512

SCORES = "btnh,bsnh->bnts"  # queries x keys -> [batch, heads, queries, keys]
COMBINE = "bnts,bsnh->btnh"  # probabilities x values -> [batch, queries, heads, dim]
D_VALUE = "bnts,btnh->bsnh"
D_PROBS = "btnh,bsnh->bnts"

_block_size = [None]  # the override of `attention_block_size`, or None


class attention_block_size(Setting):
    """Sets how many query rows one block of the blocked attention core holds.

    The blocked core (docs/recompute.md, "Blocked attention") serves the
    `MultiHeadAttention` layers of every call that `recompute_grad` recomputes,
    under every policy. By default a block holds at most 65,536 (query, key)
    pairs per batch entry and head: 128 rows at seq 512, 32 at seq 2048.
    Smaller blocks keep less, larger ones loop less. As a statement it holds
    for the rest of the process; as a context manager, inside the block
    (applied again at each entry), and on exit the size in force when the
    block was entered comes back. The size is read when a core is traced (in
    `tf.function`, `jax.jit`, `fit`: at the first step).

    ```python
    import recompute
    recompute.attention_block_size(64)          # 64 query rows per block
    with recompute.attention_block_size(None):  # back to the default inside
        ...
    ```

    Args:
        rows: an integer >= 1, or None for the default.
    """

    _cell = _block_size  # the state: `Setting`'s default methods read and write it

    def __init__(self, rows):
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(
                f"`rows` must be an integer >= 1 or None. Received: rows={rows!r}")
        super().__init__(rows)


def block_rows(queries, keys):
    """The query rows of one block for `queries` x `keys` attention."""
    rows = _block_size[0]
    if rows is None:
        rows = max(1, DEFAULT_BLOCK_ELEMENTS // max(1, keys))
        if rows >= 8:
            rows -= rows % 8
    return max(1, min(rows, queries))


HALF_PRECISION = ("float16", "bfloat16")


CORES = ("auto", "blocked", "keras")
_core_choice = ["auto"]  # what `attention_core` set


class attention_core(Setting):
    """Chooses the attention core of recomputed calls: the rule, or one core forced.

    `"auto"` (the default) follows the rule of `runs_blocked`: the blocked core
    on TensorFlow in float32, the layer's own core (Keras's `_compute_attention`,
    bert4keras's `pay_attention_to`) on JAX, where XLA:GPU's plan of the
    blocked core is above Keras's (docs/attention.md), and in half precision
    everywhere. `"keras"` runs the layer's own core everywhere; `"blocked"`
    runs the blocked core wherever it is exact (float32 and float64, the
    standard case). Each is exact: the choice moves memory and time, not
    numbers. As a statement it holds for the rest of the process; as a
    context manager, inside the block (restored on exit to what the entry
    found). It is read when a core is traced (in `tf.function`, `jax.jit`,
    `fit`: at the first step).

    ```python
    import recompute
    with recompute.attention_core("keras"):     # Keras's own core in this block
        model.fit(x, y, epochs=1)
    ```

    Args:
        core: "auto", "blocked" or "keras".
    """

    _cell = _core_choice  # the state: `Setting`'s default methods read and write it

    def __init__(self, core):
        if core not in CORES:
            raise ValueError(
                f'`core` must be one of "auto", "blocked", "keras". Received: core={core!r}')
        super().__init__(core)


def runs_blocked(engine, dtype, queries, keys):
    """Whether an attention core that is the standard case runs as the blocked core
    (True) or as the layer's own code (False: Keras's `_compute_attention`,
    bert4keras's `pay_attention_to`), for one call: the one rule, which
    `_attention.keras_blocked` and `recompute.bert4keras._attention.lean_applies`
    both consult.

    The rule:

    - half precision (float16, bfloat16): the layer's own core, whatever
      `attention_core` says. The blocked core computes the same sums in
      another order (its scores' einsum takes its operands in another order
      than Keras's; its backward takes dV, dP, dQ and dK by its own einsums,
      not as autodiff of the layer's ops rounds them), so in half precision its
      values are a half-precision ulp or more from RECOMPUTE=0's (Keras 3 on
      TensorFlow's CPU kernels, seq 37, eager: 5e-3 relative in the gradients,
      bfloat16 and float16); the layer's own core, recomputed, gives
      RECOMPUTE=0's numbers wherever recomputation itself does
      (docs/limitations.md). In float32 (and float64) both agree to float
      rounding (<= 1e-5 relative).
    - `attention_core("keras")` / `("blocked")`: that core.
    - `"auto"`: the blocked core on TensorFlow; the layer's own core on JAX,
      where XLA:GPU's plan for an H100 of keras-hub BERT-base (12 blocks,
      seq 512, float32) holds 231.0 MiB per sample under `"full"` with the
      blocked core against 78.0 with Keras's (`python -m benchmarks.gpu_plan`,
      docs/attention.md).

    Args:
        engine: the `Engine` of the call (`_flash_tf.ENGINE`, `_flash_jax.ENGINE`;
            its `name`).
        dtype: the core's compute dtype (the projected queries' dtype: a
            TensorFlow, NumPy or JAX dtype, or its name).
        queries, keys: the lengths of the query and key axes (None where known
            only when the core runs).
    """
    del queries, keys  # the rule does not depend on the shape yet
    name = getattr(dtype, "name", None) or str(dtype)
    if name in HALF_PRECISION:
        return False
    if _core_choice[0] != "auto":
        return _core_choice[0] == "blocked"
    return engine.name != "jax"


class Engine:
    """What the algorithm asks of a framework (`_flash_tf.ENGINE`, `_flash_jax.ENGINE`)."""

    name = None  # "tensorflow" or "jax"

    def rows(self, x, start, size, axis):
        """`x[..., start:start + size, ...]` along `axis` (`start` may be traced)."""

    def pad(self, x, axis, amount, value):
        """`x` with `amount` entries of `value` appended along `axis`."""

    def scan(self, body, carry, n, y_dtype, anchor):
        """`body(carry, i) -> (carry, y)` for i in 0..n-1, one at a time:
        `(carry, ys)`, the ys stacked on a new axis 0. `anchor` is an input of
        the core: the loop's buffers need not exist before it (`_flash_jax`)."""

    def vjp(self, fn, *primals):
        """`(fn(*primals), pullback)`: `pullback(cotangent)` is the tuple of gradients."""

    def einsum(self, equation, a, b):
        """The framework's einsum."""

    def cast_scalar(self, value, like):
        """The Python number `value` as a scalar of `like`'s dtype."""

    def unpack(self, bits, keys):
        """The bool mask of `keys` entries per row that `pack` packed into `bits`."""

    def drop(self, x, keep, rate):
        """The layer's dropout of `x` with the decision `keep` (its own arithmetic)."""

    def join(self, ys, rows):
        """[blocks, batch, block, ...] stacked by `scan` -> [batch, rows, ...] (the first `rows`)."""

    def zeros_like(self, x, after):
        """Zeros of `x`'s shape and dtype, which need not exist before `after` (`_flash_jax`)."""

    def length(self, x, axis):
        """The size of `x` along `axis` when it is known only when run (a tensor)."""


def _rows_of(mask):
    """Whether `mask` (rank 4, [batch, heads, queries, keys], axes maybe 1) varies along the queries."""
    return mask is not None and mask.shape[2] is not None and mask.shape[2] != 1


def _padded(E, q, mask, bits, block, extra=()):
    """The inputs with their query axis padded to a whole number of blocks
    (padding rows attend to every key: nothing masked, no dropout; their results
    are cut off). Returns `(q, mask, bits, extra, n_blocks)`."""
    queries = q.shape[1]
    if queries is None or block is None:  # a length known only when run: one block
        return q, mask, bits, extra, 1
    n = -(-queries // block)
    amount = n * block - queries
    if amount:
        q = E.pad(q, 1, amount, 0)
        extra = tuple(E.pad(x, 1, amount, 0) for x in extra)
        if _rows_of(mask):
            mask = E.pad(mask, 2, amount, True)  # (1 for a numeric mask)
        if bits is not None:
            bits = E.pad(bits, 2, amount, 0)
    return q, mask, bits, extra, n


def _block_inputs(E, i, block, q, mask, bits, keys, d_out=None):
    """Block `i`'s rows: `(q_j, mask_j, keep_j, d_out_j)` (the whole inputs when there is
    one block of a length known only when run; `d_out_j` None without `d_out`)."""
    if block is None or q.shape[1] is None:
        keep = None if bits is None else E.unpack(bits, keys)
        return q, mask, keep, d_out
    start = i * block
    q_j = E.rows(q, start, block, 1)
    mask_j = E.rows(mask, start, block, 2) if _rows_of(mask) else mask
    keep_j = None if bits is None else E.unpack(E.rows(bits, start, block, 2), keys)
    d_out_j = None if d_out is None else E.rows(d_out, start, block, 1)
    return q_j, mask_j, keep_j, d_out_j


def _keys(E, k):
    return k.shape[1] if k.shape[1] is not None else E.length(k, 1)


def forward(E, probabilities, q, k, v, mask, bits, rate, block):
    """The attended values `drop(probabilities(q, k, mask)) v`, block by block.

    Args:
        E: the `Engine`.
        probabilities: `(q_j, k, mask_j) -> P_j`, the layer's scaled scores,
            mask and softmax for a block of queries: [batch, heads, rows, keys].
        q, k, v: [batch, queries, heads, dim], [batch, keys, heads, dim],
            [batch, keys, heads, value_dim].
        mask: None or a mask of rank 4 broadcastable to [batch, heads, queries,
            keys] (the layer's own, as its softmax takes it).
        bits: None (no dropout) or the dropout's decision packed along the keys
            ([batch, heads, queries, ceil(keys / 8)] uint8).
        rate: the dropout's rate.
        block: query rows per block (None: one block; so too when the queries'
            number is known only when the core runs).
    """
    queries, keys = q.shape[1], _keys(E, k)
    qp, maskp, bitsp, _, n = _padded(E, q, mask, bits, block)

    def body(carry, i):
        q_j, mask_j, keep_j, _ = _block_inputs(E, i, block, qp, maskp, bitsp, keys)
        p = probabilities(q_j, k, mask_j)
        if keep_j is not None:
            p = E.drop(p, keep_j, rate)
        return carry, E.einsum(COMBINE, p, v)

    _, ys = E.scan(body, (), n, v.dtype, q)
    return E.join(ys, queries)


def backward(E, probabilities, q, k, v, mask, bits, rate, block, d_out):
    """`(dq, dk, dv)` of `forward` for the gradient `d_out` of its result, block by block."""
    queries, keys = q.shape[1], _keys(E, k)
    qp, maskp, bitsp, (d_outp,), n = _padded(E, q, mask, bits, block, (d_out,))

    def body(carry, i):
        d_k, d_v = carry
        q_j, mask_j, keep_j, d_out_j = _block_inputs(E, i, block, qp, maskp, bitsp, keys, d_outp)
        p, pullback = E.vjp(lambda q_j, k: probabilities(q_j, k, mask_j), q_j, k)
        dropped = p if keep_j is None else E.drop(p, keep_j, rate)
        d_v = d_v + E.einsum(D_VALUE, dropped, d_out_j)
        d_dropped = E.einsum(D_PROBS, d_out_j, v)
        d_p = d_dropped if keep_j is None else E.drop(d_dropped, keep_j, rate)
        d_q_j, d_k_j = pullback(d_p)
        return (d_k + d_k_j, d_v), d_q_j

    zeros = (E.zeros_like(k, d_out), E.zeros_like(v, d_out))
    (d_k, d_v), d_qs = E.scan(body, zeros, n, q.dtype, d_out)
    return E.join(d_qs, queries), d_k, d_v
