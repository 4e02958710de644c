"""Under `patch(policy="block")`: a Transformer block's last LayerNormalization takes its
gradient from the block's output, and the recomputation skips the feed-forward's second
product.

In BERT's post-LN block the feed-forward layer's output `o = gelu(h) @ W2 + b2` feeds
only `dropout(o) + y1` and the block's last LayerNorm, whose output is the block's output
`y` (the next block's input: the step holds it anyway). That LayerNorm's gradient needs its
normalized input `n` and its `s = sqrt(var + eps)` per row, and `n = (y - beta) / gamma`.
The gradient of `W2` needs `gelu(h)` and the incoming gradient, not `o`; a dropout's and a
sum's gradients do not read their inputs. So the recomputation of such a block
(`recompute.engine`'s, whole or in cuts of its batch):

- in its forward pass, runs the LayerNorm as bert4keras does, op for op (`_normalized`),
  and keeps `s` (`recompute.engine.kept`: one float per token, 2 KiB per sample at
  seq 512);
- in its recomputation, gives the feed-forward layer a product of zeros (`lean_call(...,
  skip_product=True)`: the gradients of its kernels and of `h` are taken from `h` and the
  incoming gradient, as ever) and returns, for the LayerNorm, the block's output from the
  forward pass (`recompute.engine.forward_outputs`, cut by cut), whose gradient is
  `_from_output`'s: with `dn = dy * gamma`,
  `dx = (dn - mean(dn) - n * mean(dn * n)) / s`, `dgamma = sum(dy * n)`, `dbeta = sum(dy)`.

The product skipped is 30% of a BERT-base block's multiply-adds at seq 512: the
recomputation costs 1.250 forward passes' worth instead of 1.350 (docs/attention.md, "A
floor lower than 1.350"). This is the "memory-efficient" LayerNorm gradient of NVIDIA
Apex's fused LayerNorm (there an opt-in).

Limits. The gradient is exact up to rounding: `n` taken back from `y` carries the
rounding of `n * gamma + beta`, about `eps * |beta| / |gamma|` in absolute terms, which is
well inside float32's agreement with RECOMPUTE=0 where `|gamma|` is not much smaller than
`|beta|` (pretrained BERTs: gammas near 1, betas near 0). A `gamma` with an entry equal to
0 loses that feature's `n`: the gradient raises `InvalidArgumentError` naming the layer and
`policy="block_keep_ffn"`, which keeps the product and takes the LayerNorm's gradient
from its input (under XLA, where asserts do nothing, the gradients are NaN instead).

`mark(block, keras)` (the patch, when it builds a block under "block") finds that wiring:
the block's one output made by a standard LayerNormalization (not conditional, zero mean,
unit variance, a `gamma` and a `beta`, float32) from an `Add` whose other input is a
`Dropout` of a `FeedForward`'s output, each of those outputs read by the next layer alone,
each layer called once in the block. Elsewhere nothing is marked and the block recomputes
its whole forward pass.
"""

import tensorflow as tf

from .. import engine

MARK_ATTR = "_recompute_norm_from_output"  # on the LayerNorm and its FeedForward: a `_Tail`


class _Tail:
    """A block's marked tail: its last LayerNorm `norm`, whose output is the block's flat
    output `index`, fed (through a dropout and a sum) by `feed_forward`."""

    def __init__(self, block, norm, feed_forward, index):
        self.block, self.norm, self.feed_forward, self.index = block, norm, feed_forward, index


def _single_output(layer):
    """`layer`'s output in its one call (None where it has none, or was called more than once)."""
    try:
        layer.get_output_at(1)
        return None  # a second call
    except (ValueError, AttributeError, IndexError):
        pass
    try:
        output = layer.output
    except (AttributeError, ValueError):
        return None
    return output if not isinstance(output, (list, tuple)) else None


def standard_norm(norm):
    """Whether `norm` (a bert4keras LayerNormalization) is the plain one `_normalized` computes."""
    return (getattr(norm, "conditional", True) is False and norm.zero_mean and norm.unit_variance
            and norm.scale is True and norm.offset is True and bool(norm.epsilon)
            and norm.built and norm.compute_dtype == "float32" and norm.dtype == "float32")


def mark(block, keras):
    """Marks `block`'s (a functional model's) last LayerNorm and its FeedForward when they are
    wired as BERT's post-LN block (the module's docstring); returns whether it did."""
    outputs = block.outputs
    if len(outputs) != 1:
        return False
    made = {}  # id(output) -> the layer that made it
    for layer in block.layers:
        output = _single_output(layer)
        if output is not None:
            made[id(output)] = layer
    readers = {}  # id(tensor) -> the layers that read it
    for layer in block.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            inputs = tf.nest.flatten(layer.input)
        except (AttributeError, ValueError):
            return False
        for x in inputs:
            readers.setdefault(id(x), []).append(layer)

    def producer(tensor, kind):
        layer = made.get(id(tensor))
        return layer if layer is not None and type(layer).__name__ == kind else None

    def read_only_by(tensor, layer):
        return readers.get(id(tensor), []) == [layer]

    norm = producer(outputs[0], "LayerNormalization")
    if norm is None or not standard_norm(norm) or readers.get(id(outputs[0])):
        return False
    add = made.get(id(norm.input))
    if not isinstance(add, keras.layers.Add) or not read_only_by(norm.input, norm):
        return False
    for branch in add.input:
        dropout = made.get(id(branch))
        if isinstance(dropout, keras.layers.Dropout) and read_only_by(branch, add):
            feed_forward = producer(dropout.input, "FeedForward")
            if feed_forward is not None and read_only_by(dropout.input, dropout):
                tail = _Tail(block, norm, feed_forward, 0)
                for layer in (norm, feed_forward):
                    object.__setattr__(layer, MARK_ATTR, tail)  # a plain attribute, not tracked
                return True
    return False


def _tail(layer):
    return layer.__dict__.get(MARK_ATTR)


def _recomputed(tail):
    """The block's output from the forward pass, if `tail`'s block is being recomputed now
    (its recomputation, not its forward pass), the LayerNorm still the plain one; else None."""
    if tail is None or not (engine.recomputing(tail.block) and engine.replaying()):
        return None
    outputs = engine.forward_outputs()
    if outputs is None or len(outputs) <= tail.index or not standard_norm(tail.norm):
        return None
    y = outputs[tail.index]
    return y if isinstance(y, tf.Tensor) and y.dtype == tf.float32 and y.shape.rank == 3 else None


def skips_product(feed_forward):
    """Whether `feed_forward`'s product is not needed now: its block is being recomputed and
    its LayerNorm takes its gradient from the block's output (`norm_call`)."""
    return _recomputed(_tail(feed_forward)) is not None


def _normalized(norm, x):
    """bert4keras's LayerNormalization of `x`, op for op (its output bit for bit), and `s`."""
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    s = tf.sqrt(tf.maximum(variance + norm.epsilon, 0.0))  # tf_keras's `backend.sqrt`
    normalized = tf.math.divide_no_nan(centered, s)
    return normalized * norm.gamma + norm.beta, s


def _from_output(norm, x, y, s):
    """`y` (the LayerNorm's output from the forward pass) as the LayerNorm of `x`: its
    gradients for `x`, `gamma` and `beta` taken from `y` and `s` (the module's docstring)."""
    gamma, beta = tf.convert_to_tensor(norm.gamma), tf.convert_to_tensor(norm.beta)
    name = norm.name

    @tf.custom_gradient
    def layer_norm(x, gamma, beta):
        def grad(dy):
            check = tf.debugging.Assert(tf.reduce_all(tf.not_equal(gamma, 0.0)), [
                f"recompute.bert4keras: policy \"block\" takes the gradient of the "
                f"LayerNormalization '{name}' from its output, which needs every entry of "
                "its `gamma` to be nonzero; use patch(policy=\"block_keep_ffn\") (the "
                "gradient from its input). Received: a `gamma` with an entry equal to 0"])
            with tf.control_dependencies([check] if check is not None else []):
                normalized = (y - beta) / gamma
            axes = list(range(dy.shape.rank - 1))
            dgamma = tf.reduce_sum(dy * normalized, axes)
            dbeta = tf.reduce_sum(dy, axes)
            dn = dy * gamma
            dx = dn - tf.reduce_mean(dn, -1, keepdims=True) \
                - normalized * tf.reduce_mean(dn * normalized, -1, keepdims=True)
            return tf.math.divide_no_nan(dx, s), dgamma, dbeta

        return tf.identity(y), grad

    return layer_norm(x, gamma, beta)


def _no_value():
    raise RuntimeError("recompute.bert4keras: a LayerNorm's kept `s` was asked for in a "
                       "forward pass; this is a bug of the package")


def norm_call(norm, call, args, kwargs):
    """A LayerNormalization's `call(norm, *args, **kwargs)` (bert4keras's own): as written,
    except as a marked block's last LayerNorm (`mark`) inside its block's recomputed call,
    where its forward pass keeps `s` and its recomputation is `_from_output`'s."""
    tail = _tail(norm)
    if tail is None or not engine.recomputing(tail.block):
        return call(norm, *args, **kwargs)
    x = args[0] if len(args) == 1 and not kwargs else None
    plain = isinstance(x, tf.Tensor) and x.dtype == tf.float32 and x.shape.rank == 3
    y = _recomputed(tail)
    if y is not None:
        if not plain:  # the FeedForward skipped its product (`skips_product`): cannot be
            raise RuntimeError(
                f"recompute.bert4keras: the LayerNormalization '{norm.name}' was called in its "
                "block's recomputation on other inputs than in its forward pass; this is a "
                f"bug of the package. Received: args={args!r}, kwargs={kwargs!r}")
        return _from_output(norm, x, y, engine.kept(_no_value))
    if engine.replaying() or not plain or not standard_norm(norm):
        return call(norm, *args, **kwargs)  # as in the forward pass below: nothing kept
    output, s = _normalized(norm, x)
    engine.kept(lambda: s)
    return output
