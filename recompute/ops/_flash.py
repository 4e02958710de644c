"""FlashAttention-2 in framework ops: an attention core that never holds [seq, seq] floats
beyond one block, and keeps its output and a per-row log-sum-exp for the backward pass.

The algorithm of FlashAttention-2 (Dao, 2023), written once, for both engines
(`_flash_tf` for TensorFlow, `_flash_jax` for JAX: each an `Engine` below). Per
head, with the layer's logits `S = mask(scale * Q K^T)` (`logits`: its scale, its
mask as its softmax applies it) and its dropout `drop` (the decision drawn once, by
the layer's own dropout op, the masks those of RECOMPUTE=0, held as bits packed along
the keys),

    P = softmax(S) (zeroed where the layer's softmax zeroes),    O = drop(P) V.

The queries are cut into row blocks of `block` rows; beyond `LONG_KEYS` keys the
keys are cut into key blocks of `KEY_BLOCK` (`key_block`):

- forward: per row block, with one key block (every key) the row's softmax in one
  pass, `exp(S_j - max) / sum` as the layer computes it; with key blocks, a running
  maximum `m` and sum `l` over the key blocks, the partial output rescaled by
  `exp(m_old - m_new)` at each one, divided by `l` at the end. Kept for the backward
  pass: Q, K, V, the mask, the bits (on JAX under `"attention"`: the seed they are
  drawn again from, `_flash_jax.Redraw`), and, with key blocks (`uses_output`; the
  TensorFlow engine keeps them always), the output O and the per-row log-sum-exp
  `lse = m + log(l)`, as its two terms ([2, batch, heads, queries]: near -1e9, an
  additive mask's fully masked row, their sum would round `log(l)` away).
- backward (the gradient `dO` arrives): `D = rowsum(dO * O)` once with key blocks,
  else per tile `rowsum(dP * P)` (the tile holds the whole row: the same sum); per tile,
  `P = exp((S - m) - log(l))` (no softmax over whole rows; without the log-sum-exp, one
  key block, the row's softmax again, as the forward pass took it), `dV += drop(P)^T dO`,
  `dP = drop(dO V^T)` (the dropout is linear: its gradient is the same selection and
  scaling), `dS = P * (dP - D)` -- which equals the softmax's `P * (dP - rowsum(dP *
  P))`, the dropout included -- and the vector-Jacobian product of `logits` with `dS`
  gives `dQ` and adds to `dK` (the scale and the mask, as autodiff takes them for the
  layer's own ops).

Up to `UNROLL` (8) blocks run as straight-line code, each block's inputs made after
the block before it (`Engine.chain`: an optimization barrier on JAX whose every
output is used, a data dependency on TensorFlow), so that one block is alive at a time and the compiler
sees no loop; beyond, a loop of the engine's (`tf.while_loop`, `jax.lax.fori_loop`).
Results equal the unblocked core's to float rounding (each entry is the same sum over
keys; dK and dV add the tiles' parts).

Block size: `block_rows(queries, keys)`, by default the rows that make a tile of at
most `DEFAULT_BLOCK_ELEMENTS` (query, key) pairs; `attention_block_size` overrides it.

Besides its `ENGINE`, each engine module gives `_attention` the same four
functions: `attention(...)` (the core with its gradient), `pack(mask)` (bits),
`ones(batch_like, shape, dtype)` and `dropout_bits(dropout, batch_like, shape,
dtype, rows)` (the decision of Keras 3's `Dropout` drawn without the whole
uniform tensor, or None where the engine cannot).
"""

import functools
import importlib

from .._setting import Setting

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
    pairs per batch entry and head: 128 rows at seq 512, and 128 rows of 512 keys
    beyond 1024 keys (`key_block`).
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


def block_rows(queries, keys, engine=None, policy=None):
    """The query rows of one block for `queries` x `keys` attention: `attention_block_size`'s
    where set; else every row (one block) under `policy="attention"` on TensorFlow up to
    `TF_KERAS_CORE_KEYS` keys (`runs_blocked`); else a tile of about
    `DEFAULT_BLOCK_ELEMENTS` (query, key) pairs. `engine`: the `Engine` of the call."""
    rows = _block_size[0]
    if rows is None and _whole_rows(engine, policy, queries, keys):
        rows = queries
    if rows is None:  # (`key_block`: the keys of one tile, where the keys are cut)
        rows = max(1, DEFAULT_BLOCK_ELEMENTS // max(1, key_block(keys) or keys))
        if rows >= 8:
            rows -= rows % 8
    return max(1, min(rows, queries))


HALF_PRECISION = ("float16", "bfloat16")


CORES = ("auto", "blocked", "keras")
_core_choice = ["auto"]  # what `attention_core` set


class attention_core(Setting):
    """Chooses the attention core of recomputed calls: the rule, or one core forced.

    `"auto"` (the default) follows the rule of `runs_blocked`: the blocked core
    on TensorFlow in float32 beyond 512 keys and on JAX in float32 (where XLA:GPU's
    plan of it is below Keras's core's: docs/attention.md) and on TensorFlow up to
    512 keys under `policy="attention"` (one block of every row), the layer's own
    core (Keras's `_compute_attention`, bert4keras's `pay_attention_to`) on
    TensorFlow up to 512 keys under `"full"`, where it is the faster at about the
    same memory, and in half precision everywhere. `"keras"` runs the layer's own core everywhere; `"blocked"`
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


def runs_blocked(engine, dtype, queries, keys, policy=None):
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
    - `"auto"` on TensorFlow: by the keys' length (`tensorflow_pays`) and the policy:
      beyond 512 keys (`TF_KERAS_CORE_KEYS`) the blocked core, where the [seq, seq]
      scores dominate (seq 1024: far less memory; docs/attention.md, "Which core
      runs"); up to 512 keys the blocked core under `policy="attention"`, as one
      block of every query row (`block_rows`; its dropout's decision kept as bits,
      not drawn again: BERT-base seq 512 on TensorFlow's CPU kernels, x1.077 and
      x1.071 against x1.104 and x1.072 with Keras's core, at the same memory; with
      `_flash_tf`'s loop over samples, less), and so under bert4keras's whole-block
      policies (`policy="block"`: BERT-base seq 512, x1.360 against x1.375 with
      bert4keras's core, 94.0 against 121.2 MiB per sample in one process, 2026-11-29),
      else (`"full"`, a length known only when the core runs) the layer's own core,
      there the faster at about the same memory.
    - `"auto"` on JAX: the blocked core (since 2026-11-28). XLA:GPU's plan for an
      H100 of keras-hub BERT-base (12 blocks, seq 512, float32) holds 19.5 MiB per
      sample under `"full"` with it against 78.0 with Keras's core, and 247.6 against
      295.6 under `"attention"` (175.5 since `"attention"` checkpoints the block:
      docs/attention.md) (`python -m benchmarks.gpu_plan --policies
      attention,full --cores blocked,keras`); at small widths, seq 256, it plans at
      or below Keras's at 2 and 8 blocks, growing by XLA's tuple buffers only
      (`tests/recompute_jax/test_gpu_plan.py`; docs/attention.md, "The last bytes
      at seq 256").

    Args:
        engine: the `Engine` of the call (`_flash_tf.ENGINE`, `_flash_jax.ENGINE`;
            its `name`).
        dtype: the core's compute dtype (the projected queries' dtype: a
            TensorFlow, NumPy or JAX dtype, or its name).
        queries, keys: the lengths of the query and key axes (None where known
            only when the core runs).
        policy: the recomputation policy the core runs under ("full", "attention",
            "block": bert4keras's whole-block policies; None: "full").
    """
    name = getattr(dtype, "name", None) or str(dtype)
    if name in HALF_PRECISION:
        return False
    if _core_choice[0] != "auto":
        return _core_choice[0] == "blocked"
    if engine.name == "tensorflow":
        return tensorflow_pays(queries, keys) or _whole_rows(engine, policy, queries, keys)
    return True  # JAX: XLA:GPU's plan of it is at or below Keras's core's (docstring)


TF_KERAS_CORE_KEYS = 512  # under "auto", TensorFlow runs the layer's own core up to this many keys


# The policies under which, on TensorFlow up to `TF_KERAS_CORE_KEYS` keys, the rule runs the
# blocked core as one block of every row: "attention", and bert4keras's whole-block policies
# ("block", "block_keep_ffn"; its patch passes "block"). Measured (docs/attention.md): as
# fast as the layer's own core there, with less memory (one sample's [seq, seq] at a time).
WHOLE_ROW_POLICIES = ("attention", "block")


def _whole_rows(engine, policy, queries, keys):
    """Whether the rule runs the blocked core as one block of every query row: under a
    policy of `WHOLE_ROW_POLICIES` on TensorFlow, both lengths known, up to
    `TF_KERAS_CORE_KEYS` keys."""
    return (policy in WHOLE_ROW_POLICIES and getattr(engine, "name", None) == "tensorflow"
            and None not in (queries, keys) and not tensorflow_pays(queries, keys))


def tensorflow_pays(queries, keys):
    """Whether the blocked core pays on TensorFlow (`runs_blocked` under `"auto"`, float32
    and float64): beyond `TF_KERAS_CORE_KEYS` (512) keys. Measured on TensorFlow's CPU kernels
    (docs/attention.md, "Which core runs"): at 512 keys (BERT-base, 12 blocks) the layer's
    own core is the faster under both policies at about the same memory; at 1024 keys its
    backward pass holds a block's whole [heads, seq, seq] tensors, and the blocked core
    holds far less. The keys decide (in self-attention the [queries, keys] working set
    grows with them; a few queries over many keys run blocked too: not measured).
    A length known only when the core runs (None): the layer's own core -- the blocked
    core could not size its blocks and would run as one block of every row and key, the
    layer's own working set, only slower."""
    del queries
    return keys is not None and keys > TF_KERAS_CORE_KEYS


# The operations that are one framework function each, in one table: name -> (TensorFlow's,
# JAX's, the keyword arguments both are called with). An `Engine` has each as an attribute
# of that name, its framework's function (`Engine.__getattr__`).
FUNCTIONS = {
    "einsum": ("tensorflow:einsum", "jax.numpy:einsum", {}),
    "stack": ("tensorflow:stack", "jax.numpy:stack", {}),  # on a new axis 0
    "transpose": ("tensorflow:transpose", "jax.numpy:transpose", {}),
    "exp": ("tensorflow:exp", "jax.numpy:exp", {}),
    "log": ("tensorflow:math.log", "jax.numpy:log", {}),
    "maximum": ("tensorflow:maximum", "jax.numpy:maximum", {}),  # elementwise
    "constant": ("tensorflow:constant", "jax.numpy:asarray", {}),  # of a NumPy array
    # over the last axis, kept as an axis of 1
    "row_max": ("tensorflow:reduce_max", "jax.numpy:max", {"axis": -1, "keepdims": True}),
    "row_sum": ("tensorflow:reduce_sum", "jax.numpy:sum", {"axis": -1, "keepdims": True}),
    # the softmax Keras's and bert4keras's layers call
    "softmax": ("tensorflow:nn.softmax", "jax.nn:softmax", {"axis": -1}),
}
_COLUMN = {"tensorflow": 0, "jax": 1}


def framework_function(path, fixed):
    """The function at `path` ("module:attribute.attribute"), with the keyword arguments
    `fixed` bound."""
    module, _, attributes = path.partition(":")
    function = importlib.import_module(module)
    for attribute in attributes.split("."):
        function = getattr(function, attribute)
    return functools.partial(function, **fixed) if fixed else function


class Engine:
    """What the algorithm asks of a framework (`_flash_tf.ENGINE`, `_flash_jax.ENGINE`):
    the methods below, and the functions of `FUNCTIONS` by name (`engine.exp(x)`)."""

    name = None  # "tensorflow" or "jax"

    def __getattr__(self, name):
        """One of `FUNCTIONS`, found on first use (JAX is imported only where it runs)."""
        if name not in FUNCTIONS or self.name not in _COLUMN:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        *paths, fixed = FUNCTIONS[name]
        function = framework_function(paths[_COLUMN[self.name]], fixed)
        setattr(self, name, function)
        return function

    def rows(self, x, start, size, axis):
        """`x[..., start:start + size, ...]` along `axis` (`start` may be traced)."""

    def pad(self, x, axis, amount, value):
        """`x` with `amount` entries of `value` appended along `axis`."""

    def scan(self, body, carry, n, y_dtypes, anchor):
        """`body(carry, i) -> (carry, ys)` for i in 0..n-1, one at a time, in a loop
        (`ys` a tuple): `(carry, stacked)`, each of the ys stacked on a new axis 0.
        `anchor` is an input of the core: the loop's buffers need not exist before
        it (`_flash_jax`)."""

    def ordered(self, tensors, gate):
        """`tensors` (a list), made to exist only once `gate` (a list) does, where the
        engine's executor would otherwise run them in any order (TensorFlow's graphs); as
        they are where the compiler orders for memory itself (XLA)."""
        return list(tensors)

    def chain(self, tensors, gate):
        """`(tensors, gate)` (two lists), the tensors made to exist only once `gate` does:
        the unrolled blocks are chained so that one block is alive at a time. The caller
        uses what comes back in place of both lists (on JAX they pass through one
        optimization barrier, whose outputs XLA drops where they are not used: a gate
        whose outputs went unused stopped gating)."""

    def vjp(self, fn, *primals):
        """`(out, aux, pullback)` of `fn(*primals) -> (out, aux)`: `pullback(cotangent)`
        is the tuple of the primals' gradients (`aux` is not differentiated)."""

    def cast_scalar(self, value, like):
        """The Python number `value` as a scalar of `like`'s dtype."""

    def unpack(self, bits, keys):
        """The bool mask of `keys` entries per row that `pack` packed into `bits`."""

    def drop(self, x, keep, rate):
        """The layer's dropout of `x` with the decision `keep` (its own arithmetic)."""

    def join(self, ys, rows, axis):
        """[blocks, ..., block (at `axis` + 1), ...] stacked by `scan` -> the blocks
        joined along `axis` (the first `rows`)."""

    def zeros_like(self, x, after):
        """Zeros of `x`'s shape and dtype, which need not exist before `after` (`_flash_jax`)."""

    def zeros(self, batch_like, shape, dtype, after):
        """Zeros of `[batch of batch_like] + shape`, which need not exist before `after`."""

    def length(self, x, axis):
        """The size of `x` along `axis` when it is known only when run (a tensor)."""

    def where(self, condition, x, y):
        """`x` where `condition`, else `y` (a Python number or a tensor)."""


UNROLL = 8  # up to this many blocks run unrolled (straight-line, chained); beyond, a loop
LONG_KEYS = 1024  # beyond this many keys, the keys are cut into blocks of KEY_BLOCK
KEY_BLOCK = 512

ROW_DOT = "btnh,btnh->bnt"  # rowsum(dO * O): [batch, heads, queries]
COMBINE_HEADS = "bnts,bsnh->bnth"  # a key block's part of O, heads before rows
NEG_INF = float("-inf")


def key_block(keys):
    """The keys of one key block for attention over `keys` keys: None (one block of every key:
    no running maximum) up to `LONG_KEYS`, else `KEY_BLOCK`. Up to 1024 keys a block of
    every key holds at least 64 query rows of the default 65,536 pairs, and its softmax is
    one pass; beyond, a row block would shrink below 64 rows (32 at 2048 keys), so the keys
    are cut instead and each row block keeps a running maximum and sum."""
    if keys is None or keys <= LONG_KEYS:
        return None
    return KEY_BLOCK


def _rank4(mask):
    return () if mask is None else (mask if isinstance(mask, tuple) else (mask,))


def _along(mask, axis):
    """Whether `mask` (rank 4, [batch, heads, queries, keys], axes maybe 1) varies along `axis`."""
    return mask is not None and mask.shape[axis] is not None and mask.shape[axis] != 1


def _map_mask(mask, fn):
    """`fn` applied to the mask, or to each mask of a tuple of masks (None kept)."""
    if isinstance(mask, tuple):
        return tuple(None if m is None else fn(m) for m in mask)
    return None if mask is None else fn(mask)


def _cut(E, mask, axis, start, size):
    """The mask(s) cut to `[start, start + size)` along `axis` where they vary along it."""
    return _map_mask(mask, lambda m: E.rows(m, start, size, axis) if _along(m, axis) else m)


def _padded(E, q, mask, bits, block, extra=()):
    """The inputs with their query axis padded to a whole number of blocks
    (padding rows attend to every key: nothing masked, no dropout; their results
    are cut off). `extra`: `(tensor, axis)` pairs padded with zeros along `axis`.
    Returns `(q, mask, bits, extra, n_blocks)`."""
    queries = q.shape[1]
    if queries is None or block is None:  # a length known only when run: one block
        return q, mask, bits, tuple(x for x, _ in extra), 1
    n = -(-queries // block)
    amount = n * block - queries
    if amount:
        q = E.pad(q, 1, amount, 0)
        extra = tuple((None if x is None else E.pad(x, axis, amount, 0), axis)
                      for x, axis in extra)
        mask = _map_mask(mask, lambda m: E.pad(m, 2, amount, True) if _along(m, 2) else m)
        if bits is not None:
            bits = E.pad(bits, 2, amount, 0)
    return q, mask, bits, tuple(x for x, _ in extra), n


def _keys_padded(E, k, v, mask, bits, keys, kb):
    """Keys, values, mask(s) and bits padded along the keys to a whole number of key blocks
    of `kb` (a multiple of 8: the bits' bytes are cut with them), and `(n_key_blocks,
    columns)`: columns, where padded, the bool [n * kb] of the real keys, else None."""
    if kb is None:
        return k, v, mask, bits, 1, None
    n = -(-keys // kb)
    amount = n * kb - keys
    if not amount:
        return k, v, mask, bits, n, None
    import numpy as np

    k, v = E.pad(k, 1, amount, 0), E.pad(v, 1, amount, 0)
    mask = _map_mask(mask, lambda m: E.pad(m, 3, amount, 0) if _along(m, 3) else m)
    if bits is not None and bits.shape[-1] < n * kb // 8:
        bits = E.pad(bits, 3, n * kb // 8 - bits.shape[-1], 0)
    return k, v, mask, bits, n, E.constant(np.arange(n * kb) < keys)


def _blocks(E, body, carry, n, y_dtypes, anchor, sources):
    """`body(carry, i, sources) -> (carry, ys)` for the blocks i = 0..n-1, one at a time:
    `(carry, stacked ys)`; `sources` (a list, None entries allowed) are the tensors the
    blocks cut their inputs from. Up to `UNROLL` blocks, straight-line code: before block
    i > 0, the sources, the carry and the ys of block i - 1 pass through one
    `Engine.chain`, and what comes out replaces all three, so that block i's inputs exist
    only after block i - 1 and the compiler holds one block at a time (every output of
    the barrier used: XLA drops the unused ones, and with them the order); beyond, the
    engine's loop."""
    if n > UNROLL:
        return E.scan(lambda c, i: body(c, i, sources), carry, n, y_dtypes, anchor)
    stacked = []
    for i in range(n):
        if i:
            sources, carry, stacked[-1] = _chain(E, sources, carry, stacked[-1])
        carry, ys = body(carry, i, sources)
        stacked.append(ys)
    return carry, tuple(E.stack([ys[j] for ys in stacked]) for j in range(len(y_dtypes)))


def _flat(carry):
    return list(carry) if isinstance(carry, (tuple, list)) else [carry]


def _chain(E, sources, carry, ys):
    """`(sources, carry, ys)` through `Engine.chain`: the sources made after the carry and
    the ys, all three as they come out (None entries kept, the structures kept)."""
    parts = [list(sources), _flat(carry), list(ys)]
    present = [(p, i) for p, part in enumerate(parts) for i, t in enumerate(part)
               if t is not None]
    n_sources = sum(1 for p, _ in present if p == 0)
    made, gate = E.chain([parts[p][i] for p, i in present[:n_sources]],
                         [parts[p][i] for p, i in present[n_sources:]])
    for (p, i), t in zip(present, list(made) + list(gate)):
        parts[p][i] = t
    if isinstance(carry, tuple):
        carry = tuple(parts[1])
    elif isinstance(carry, list):
        carry = parts[1]
    else:
        carry = parts[1][0]
    return parts[0], carry, tuple(parts[2])


def _keys(E, k):
    return k.shape[1] if k.shape[1] is not None else E.length(k, 1)


def _query_rows(E, i, block, known, tensors):
    """Block `i`'s rows of `tensors` ((tensor, axis) pairs; the whole tensor where there is
    one block of a length known only when run)."""
    if block is None or not known:
        return [t for t, _ in tensors]
    return [None if t is None else E.rows(t, i * block, block, axis) for t, axis in tensors]


def _row_masks(E, mask, bits, i, block, known):
    """Row block `i`'s mask and dropout bits (each None where there is none)."""
    mask_i = _cut(E, mask, 2, i * block, block) if block is not None and known else mask
    return mask_i, _bits_rows(E, bits, i, block, known)


def _bits_rows(E, bits, i, block, known):
    if bits is None or block is None or not known:
        return bits
    return E.rows(bits, i * block, block, 2)


def _key_part(E, c, kb, k, v, mask, bits, columns):
    """Key block `c`: `(k_c, v_c, mask_c, keep_c, columns_c)` (keep_c: the unpacked bits)."""
    k_c, v_c = E.rows(k, c * kb, kb, 1), E.rows(v, c * kb, kb, 1)
    mask_c = _cut(E, mask, 3, c * kb, kb)
    keep = None if bits is None else E.unpack(E.rows(bits, c * (kb // 8), kb // 8, 3), kb)
    cols = None if columns is None else E.rows(columns, c * kb, kb, 0)
    return k_c, v_c, mask_c, keep, cols


def _softmax_block(E, logits, q_j, k, mask_j, keep, v, rate):
    """One block of every key: `(O_j, lse_j)` -- the row's softmax in one pass, the
    framework's own (so the output is the layer's, bit for bit where the ops are), dropped,
    times V; `lse = max - log(max of the softmax)`, no second pass of exponentials."""
    s, valid = logits(q_j, k, mask_j)
    p = E.softmax(s)
    # log(sum): the softmax's largest entry is exp(0) / sum
    lse = E.stack([E.row_max(s)[..., 0], -E.log(E.row_max(p))[..., 0]])
    return E.einsum(COMBINE, _selected(E, p, valid, keep, rate), v), lse


def _selected(E, p, valid, keep, rate):
    """`p` with the masked-out entries zeroed (`valid`) and the dropout's selection and scaling
    applied (`keep`, the unpacked bits; None: no dropout)."""
    if valid is not None:
        p = E.where(valid, p, 0.0)
    if keep is not None:
        p = E.drop(p, keep, rate)
    return p


def _online_block(E, logits, q_j, mask_j, bits_j, parts, anchor, rate):
    """Key blocks with a running maximum and sum (FlashAttention-2's forward for one row
    block): `(O_j, lse_j)`. `parts = (k, v, columns, n_key_blocks, kb)`."""
    k, v, columns, nk, kb = parts

    def body(carry, c, sources):
        m, total, acc = carry
        q_g, bits_g = sources
        k_c, v_c, mask_c, keep, cols = _key_part(E, c, kb, k, v, mask_j, bits_g, columns)
        s, valid = logits(q_g, k_c, mask_c)
        if cols is not None:  # padded keys: out of every row
            s = E.where(cols, s, NEG_INF)
        m_new = E.maximum(m, E.row_max(s))
        m_use = E.where(m_new == NEG_INF, 0.0, m_new)  # a row with no key yet (bias of -inf)
        alpha = E.exp(m - m_use)
        e = E.exp(s - m_use)
        total = alpha * total + E.row_sum(e)
        acc = acc * alpha + E.einsum(COMBINE_HEADS, _selected(E, e, valid, keep, rate), v_c)
        return (m_new, total, acc), ()

    heads, rows = q_j.shape[2], q_j.shape[1]  # (static: `Engine.rows` keeps the size)
    zeros = E.zeros(q_j, [heads, rows, 1], q_j.dtype, anchor)  # [batch, heads, rows, 1]
    acc = E.zeros(q_j, [heads, rows, v.shape[3]], v.dtype, anchor)
    (m, total, acc), _ = _blocks(E, body, (zeros + NEG_INF, zeros, acc), nk, (), anchor,
                                 [q_j, bits_j])
    m_use = E.where(m == NEG_INF, 0.0, m)
    return E.transpose(acc / total, [0, 2, 1, 3]), E.stack([m_use[..., 0], E.log(total)[..., 0]])


def forward(E, logits, q, k, v, mask, bits, rate, block, key_block=None):
    """FlashAttention-2's forward pass: `(O, lse)`, the attended values
    `drop(softmax(logits(q, k, mask))) v` and the per-row log-sum-exp of the logits as
    its two terms, the row's maximum and the log of its sum of exponentials
    ([2, batch, heads, queries]: a row of logits near -1e9 would lose the second to
    rounding in their sum), row block by row block (and key block by key block with a
    running maximum and sum when `key_block` is given).

    Args:
        E: the `Engine`.
        logits: `(q_j, k_c, mask_jc) -> (s, valid)`: the layer's scaled, masked scores
            for a block of queries and keys ([batch, heads, rows, keys]; what enters its
            softmax) and None or the bool entries its softmax keeps (Keras zeroes the
            others after the softmax: a fully masked row is all zeros).
        q, k, v: [batch, queries, heads, dim], [batch, keys, heads, dim],
            [batch, keys, heads, value_dim].
        mask: None, a mask of rank 4 broadcastable to [batch, heads, queries, keys],
            or a tuple of such (None entries allowed), cut into blocks along the axes
            where it varies and handed to `logits`.
        bits: None (no dropout) or the dropout's decision packed along the keys
            ([batch, heads, queries, ceil(keys / 8)] uint8).
        rate: the dropout's rate.
        block: query rows per block (None: one block; so too when the queries'
            number is known only when the core runs).
        key_block: keys per key block (a multiple of 8), or None: every key in one block.
    """
    queries, keys = q.shape[1], _keys(E, k)
    known = q.shape[1] is not None
    qp, maskp, bitsp, _, n = _padded(E, q, mask, bits, block)
    if key_block is not None and (not isinstance(keys, int) or key_block >= keys):
        key_block = None
    kp, vp, maskp, bitsp, nk, columns = _keys_padded(E, k, v, maskp, bitsp, keys, key_block)

    def body(carry, i, sources):
        q_s, bits_s = sources
        (q_j,) = _query_rows(E, i, block, known, [(q_s, 1)])
        mask_j, bits_j = _row_masks(E, maskp, bits_s, i, block, known)
        if key_block is None:
            keep = None if bits_j is None else E.unpack(bits_j, keys)
            return carry, _softmax_block(E, logits, q_j, k, mask_j, keep, v, rate)
        return carry, _online_block(E, logits, q_j, mask_j, bits_j,
                                    (kp, vp, columns, nk, key_block), q, rate)

    _, (outs, lses) = _blocks(E, body, (), n, (v.dtype, q.dtype), q, [qp, bitsp])
    return E.join(outs, queries, 1), E.join(lses, queries, 3)


def uses_output(keys, key_block):
    """Whether `backward` needs the forward pass's output and log-sum-exp for `keys` keys:
    only with key blocks (`rowsum(dO * O)` then stands for the row's sum over every key
    block); with one key block each tile holds the whole row: the sum is `rowsum(dP * P)`
    there, and `P` the row's softmax, taken again (`lse` None)."""
    return key_block is not None and isinstance(keys, int) and key_block < keys


def _added(d_k, d_k_j, d_v, d_v_j):
    """`(d_k + d_k_j, d_v + d_v_j)`, the sums starting from None (one row block)."""
    return (d_k_j if d_k is None else d_k + d_k_j), (d_v_j if d_v is None else d_v + d_v_j)


def _tile(E, logits, rate, q_j, k_c, v_c, mask_c, keep, cols, d_out_j, dot_j, lse_j):
    """One tile's `(dq, dk, dv)` in `backward`."""
    def scores(q_j, k_c):
        s, valid = logits(q_j, k_c, mask_c)
        if cols is not None:
            s = E.where(cols, s, NEG_INF)
        return s, valid

    s, valid, pullback = E.vjp(scores, q_j, k_c)
    if lse_j is None:  # one key block, no lse kept: the row's softmax, as the forward's
        p = E.softmax(s)
    else:
        # (s - max) - log(sum), not s - lse: a row of logits near -1e9 (a fully masked
        # row, additive masks) would lose log(sum) to rounding in lse
        p = E.exp((s - lse_j[0][..., None]) - lse_j[1][..., None])
    if valid is not None:
        p = E.where(valid, p, 0.0)
    dropped = p if keep is None else E.drop(p, keep, rate)
    d_v = E.einsum(D_VALUE, dropped, d_out_j)
    # dO V^T after dV: the dropped probabilities are freed first (one [rows, keys] float
    # fewer alive: 3 rather than 4 at BERT-base seq 512 on TensorFlow, from its allocator)
    d_out_j, v_c = E.ordered([d_out_j, v_c], [d_v])
    d_dropped = E.einsum(D_PROBS, d_out_j, v_c)
    d_p = d_dropped if keep is None else E.drop(d_dropped, keep, rate)
    dot = E.row_sum(d_p * p) if dot_j is None else dot_j[..., None]
    d_q, d_k = pullback(p * (d_p - dot))
    return d_q, d_k, d_v


def backward(E, logits, q, k, v, mask, bits, rate, block, d_out, out, lse, key_block=None):
    """FlashAttention-2's backward pass: `(dq, dk, dv)` of `forward` for the gradient
    `d_out` of its output `out`, from `lse` (no softmax over whole rows): per block,
    `P = exp(s - lse)` (`lse` None, one key block: the row's softmax again; `out` None too) (zeroed where `logits` says the softmax zeroes), `dV += drop(P)^T dO`,
    `dP = drop(dO V^T)` (the dropout's selection and scaling: it is linear),
    `dS = P * (dP - rowsum(dO * O))`, and the vector-Jacobian product of `logits` with
    `dS` gives `dQ` and `dK` (the scale and the mask's gradient, as autodiff takes them for
    the layer's own ops)."""
    queries, keys = q.shape[1], _keys(E, k)
    known = q.shape[1] is not None
    # rowsum(dO * O): [batch, heads, queries]; without `out` (one key block: `uses_output`),
    # per tile as rowsum(dP * P), the same sum over the row's keys
    row_dot = None if out is None else E.einsum(ROW_DOT, d_out, out)
    qp, maskp, bitsp, (d_outp, row_dotp, lsep), n = _padded(
        E, q, mask, bits, block, ((d_out, 1), (row_dot, 2), (lse, 3)))
    if key_block is not None and (not isinstance(keys, int) or key_block >= keys):
        key_block = None
    kp, vp, maskp, bitsp, nk, columns = _keys_padded(E, k, v, maskp, bitsp, keys, key_block)

    def part(*tile):
        return _tile(E, logits, rate, *tile)

    def body(carry, i, sources):
        d_k, d_v = carry
        q_s, d_out_s, bits_s = sources
        q_j, d_out_j = _query_rows(E, i, block, known, [(q_s, 1), (d_out_s, 1)])
        dot_j, lse_j = _query_rows(E, i, block, known, [(row_dotp, 2), (lsep, 3)])
        mask_j, bits_j = _row_masks(E, maskp, bits_s, i, block, known)
        if key_block is None:
            keep = None if bits_j is None else E.unpack(bits_j, keys)
            d_q_j, d_k_j, d_v_j = part(q_j, k, v, mask_j, keep, None, d_out_j, dot_j, lse_j)
            return _added(d_k, d_k_j, d_v, d_v_j), (d_q_j,)

        def inner(d_q_j, c, sources):
            q_g, bits_g = sources
            k_c, v_c, mask_c, keep, cols = _key_part(E, c, key_block, kp, vp, mask_j, bits_g,
                                                     columns)
            d_q_c, d_k_c, d_v_c = part(q_g, k_c, v_c, mask_c, keep, cols, d_out_j, dot_j, lse_j)
            return d_q_j + d_q_c, (d_k_c, d_v_c)

        d_q_j, (d_ks, d_vs) = _blocks(E, inner, E.zeros_like(q_j, d_out), nk,
                                      (k.dtype, v.dtype), d_out, [q_j, bits_j])
        return _added(d_k, E.join(d_ks, keys, 1), d_v, E.join(d_vs, keys, 1)), (d_q_j,)

    # one row block: its dK and dV are the whole (no zeros to start from, nor their buffers)
    zeros = (None, None) if n == 1 else (E.zeros_like(k, d_out), E.zeros_like(v, d_out))
    (d_k, d_v), (d_qs,) = _blocks(E, body, zeros, n, (q.dtype,), d_out, [qp, d_outp, bitsp])
    return E.join(d_qs, queries, 1), d_k, d_v
