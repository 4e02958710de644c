"""The BERT-shaped Keras 3 encoder that `recompute_memory` and `recompute_distribute` train,
and its shape options.

Post-LN transformer blocks (self-attention, GELU FFN, dropout, two
LayerNorms) whose `call` is decorated with `recompute_grad`, a CLS
classifier, Adam. Two kinds of block (`BLOCKS`):

- "lean": avoids memory that TensorFlow would waste in *both* modes (a GELU
  with a one-tensor gradient, the attention scale on `q`, dropout drawing 16
  random bits per element): the reasons are in the docstrings below. Policy
  "full" only (its attention is not a `MultiHeadAttention`).
- "standard": what a Keras user writes: `keras.layers.MultiHeadAttention`,
  `Dense(activation="gelu")`, `keras.layers.Dropout`, `LayerNormalization`.
  Policies "full" and "attention".

Both use fused in-place Adam (the same update as Keras's). `build_jax_model`
builds the standard encoder for Keras 3 on JAX (`recompute_memory --backend jax`).
"""

import math

from . import harness

SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "seq", "vocab", "dropout")
BLOCKS = {"lean": ("full",), "standard": ("full", "attention")}  # block -> its policies


def build_model(cfg, block="lean", policy="full"):
    """Returns (model, optimizer, train_step) for the configuration `cfg`, with
    blocks of kind `block` decorated with `recompute_grad(policy=policy)`."""
    if policy not in BLOCKS[block]:
        raise ValueError(f"policy {policy!r}: the {block!r} block has policies {BLOCKS[block]}")
    import keras
    import tensorflow as tf

    from recompute import recompute_grad

    dropout_cls = _dropout_class()
    block_cls = _lean_block_class(cfg, dropout_cls) if block == "lean" else standard_block_class(cfg)
    block_cls.call = recompute_grad(block_cls.call, policy=policy)
    drop_cls = keras.layers.Dropout if block == "standard" else dropout_cls  # embedding's, head's

    keras.utils.set_random_seed(0)
    model = _encoder_class(cfg, block_cls, drop_cls)()
    model(tf.zeros([1, cfg["seq"]], tf.int32), training=False)
    optimizer = _fused_adam_class()(1e-4)
    optimizer.build(model.trainable_variables)
    return model, optimizer, _train_step(model, optimizer)


def _gelu():
    """The lean block's GELU (a new `tf.custom_gradient` function per model)."""
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        """Exact (erf) GELU that keeps one [batch, seq, ffn] tensor for its gradient.

        Autodiff through `keras.activations.gelu` (a composite of TensorFlow
        ops) keeps several of its intermediates per block, and its derivative
        ops that need no incoming gradient run during the forward pass and wait
        there. This keeps what a fused GELU kernel keeps, one tensor (here the
        derivative, so that the gradient is a single in-place multiply), and
        orders the forward ops so that at most three such tensors are alive.
        """
        slope = x * (tf.exp(-0.5 * tf.square(x)) * (1.0 / math.sqrt(2.0 * math.pi)))
        with tf.control_dependencies([slope]):
            cdf = 0.5 * (1.0 + tf.math.erf(x * (1.0 / math.sqrt(2.0))))
        derivative = cdf + slope
        with tf.control_dependencies([derivative]):
            y = x * cdf

        def grad(dy):
            return dy * derivative

        return y, grad

    return gelu


def _dropout_class():
    """The lean encoder's `Dropout` class (a new class per model)."""
    import keras
    import tensorflow as tf

    class Dropout(keras.layers.Layer):
        """Inverted dropout like `keras.layers.Dropout`, drawing 16 random bits per element.

        `keras.layers.Dropout` draws a float32 per element with TensorFlow's
        single-threaded Philox kernel, a quarter to a third of this model's
        forward pass on CPU (the [seq, seq] attention masks) -- paid again by
        every recomputation. Here each 32-bit draw gives two elements their
        16-bit keep test (the rate is rounded to a multiple of 1/65536): half
        the random numbers. The seed comes from a `SeedGenerator`, as in Keras
        (seeded by `keras.utils.set_random_seed`), so a recomputation replays
        the mask.
        """

        def __init__(self, rate, **kwargs):
            super().__init__(**kwargs)
            self.rate = rate
            self.threshold = min(int(round(rate * 65536)), 65535)
            self.seed_generator = keras.random.SeedGenerator()

        def call(self, x, training=None):
            if not training or self.rate == 0.0:
                return x
            seed = tf.cast(self.seed_generator.next() % (2**31 - 1), tf.int32)
            if x.shape[-1] is not None and x.shape[-1] % 2 == 0:
                shape = tf.concat([tf.shape(x)[:-1], [tf.shape(x)[-1] // 2]], 0)
                bits = tf.random.stateless_uniform(
                    shape, seed, minval=None, maxval=None, dtype=tf.uint32
                )
                keep = tf.reshape(tf.bitcast(bits, tf.uint16), tf.shape(x)) >= self.threshold
            else:
                keep = tf.random.stateless_uniform(tf.shape(x), seed) >= self.rate
            return tf.where(keep, x * (1.0 / (1.0 - self.rate)), 0.0)

    return Dropout


def _lean_block_class(cfg, Dropout):
    """The "lean" block class for `cfg` (a new class per model), its dropout `Dropout`."""
    import keras
    import tensorflow as tf

    hidden, heads, ffn, rate = cfg["hidden"], cfg["heads"], cfg["ffn"], cfg["dropout"]
    head_dim = hidden // heads
    gelu = _gelu()

    class Block(keras.layers.Layer):
        """Post-LN transformer block: self-attention + FFN, 2 LayerNorms, residuals, dropout."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.qkv = keras.layers.Dense(3 * hidden, name="qkv")
            self.attn_out = keras.layers.Dense(hidden, name="attn_out")
            self.attn_drop = Dropout(rate)
            self.drop1 = Dropout(rate)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-12, name="norm1")
            self.ffn_in = keras.layers.Dense(ffn, activation=gelu, name="ffn_in")
            self.ffn_out = keras.layers.Dense(hidden, name="ffn_out")
            self.drop2 = Dropout(rate)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-12, name="norm2")

        def build(self, input_shape):
            self.qkv.build(input_shape)
            self.attn_out.build(input_shape)
            self.norm1.build(input_shape)
            self.ffn_in.build(input_shape)
            self.ffn_out.build(tuple(input_shape[:-1]) + (ffn,))
            self.norm2.build(input_shape)

        def call(self, x, training=None):
            batch, length = tf.shape(x)[0], tf.shape(x)[1]
            qkv = tf.reshape(self.qkv(x), [batch, length, 3, heads, head_dim])
            # [batch, heads, seq, d] each; unstack (not qkv[i]) so that the
            # gradient is one stack, not three zero-padded full-size tensors.
            q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))
            # Keeps what any framework keeps: the softmax output, the 1-byte
            # dropout mask and the dropped-out probabilities, one of each. (The
            # scale goes on q: on the scores, TensorFlow's gradient of the
            # multiply would keep the [seq, seq] scores too.)
            q = q * (1.0 / math.sqrt(head_dim))
            probs = tf.nn.softmax(tf.matmul(q, k, transpose_b=True), axis=-1)
            probs = self.attn_drop(probs, training=training)
            context = tf.matmul(probs, v)  # [batch, heads, seq, d]
            context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch, length, hidden])
            x = self.norm1(x + self.drop1(self.attn_out(context), training=training))
            y = self.ffn_out(self.ffn_in(x))
            return self.norm2(x + self.drop2(y, training=training))

    return Block


def _encoder_class(cfg, block_cls, drop_cls):
    """The encoder model class for `cfg`: embeddings, blocks of `block_cls`, a CLS classifier;
    `drop_cls` for the embedding's and the head's dropout."""
    import keras
    import tensorflow as tf

    hidden, seq, vocab, rate = cfg["hidden"], cfg["seq"], cfg["vocab"], cfg["dropout"]

    class Encoder(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(vocab, hidden, name="tokens")
            self.positions = keras.layers.Embedding(seq, hidden, name="positions")
            self.norm = keras.layers.LayerNormalization(epsilon=1e-12, name="emb_norm")
            self.drop = drop_cls(rate)
            self.blocks = [block_cls(name=f"block_{i}") for i in range(cfg["layers"])]
            self.pool = keras.layers.Dense(hidden, activation="tanh", name="pool")
            self.head_drop = drop_cls(rate)
            self.classifier = keras.layers.Dense(2, name="classifier")

        def call(self, ids, training=None):
            x = self.tokens(ids) + self.positions(tf.range(tf.shape(ids)[1]))[None]
            x = self.drop(self.norm(x), training=training)
            for block in self.blocks:
                x = block(x, training=training)
            pooled = self.head_drop(self.pool(x[:, 0]), training=training)
            return self.classifier(pooled)

    return Encoder


def _fused_adam_class():
    """`FusedAdam` (a new class per model)."""
    import keras
    import tensorflow as tf

    class FusedAdam(keras.optimizers.Adam):
        """Keras's Adam (same update), applied in place by TensorFlow's fused kernel.

        Keras's own update makes several temporaries of each variable's size,
        and densifies the sparse embedding gradient twice: a fixed spike of
        ~4x the 30522 x 768 table at the end of the step that would hide the
        activation peak of small batches with recomputation on.
        """

        def update_step(self, gradient, variable, learning_rate):
            if isinstance(gradient, tf.IndexedSlices):
                gradient = tf.convert_to_tensor(gradient)
            dtype = variable.dtype
            step = tf.cast(self.iterations + 1, dtype)
            index = self._get_variable_index(variable)
            tf.raw_ops.ResourceApplyAdam(
                var=variable.handle,
                m=self._momentums[index].handle,
                v=self._velocities[index].handle,
                beta1_power=tf.pow(tf.cast(self.beta_1, dtype), step),
                beta2_power=tf.pow(tf.cast(self.beta_2, dtype), step),
                lr=tf.cast(learning_rate, dtype),
                beta1=tf.cast(self.beta_1, dtype),
                beta2=tf.cast(self.beta_2, dtype),
                epsilon=tf.cast(self.epsilon, dtype),
                grad=tf.cast(gradient, dtype),
            )

    return FusedAdam


def _train_step(model, optimizer):
    """The compiled train step: the classifier's loss, its gradients, `optimizer.apply`."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(ids, labels):
        with tf.GradientTape() as tape:
            logits = model(ids, training=True)
            loss = loss_fn(labels, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


def standard_block_class(cfg):
    """The "standard" block as a Keras user writes it (any Keras 3 backend); a new class per
    call, so that each model decorates its own."""
    import keras

    hidden, heads, ffn, rate = cfg["hidden"], cfg["heads"], cfg["ffn"], cfg["dropout"]

    class StandardBlock(keras.layers.Layer):
        """Post-LN block: `MultiHeadAttention`, `Dense(activation="gelu")`, `Dropout`, `LayerNormalization`."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=rate,
                                                             name="attention")
            self.drop1 = keras.layers.Dropout(rate)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-12, name="norm1")
            self.ffn_in = keras.layers.Dense(ffn, activation="gelu", name="ffn_in")
            self.ffn_out = keras.layers.Dense(hidden, name="ffn_out")
            self.drop2 = keras.layers.Dropout(rate)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-12, name="norm2")

        def call(self, x, training=None):
            a = self.attention(x, x, training=training)
            x = self.norm1(x + self.drop1(a, training=training))
            y = self.ffn_out(self.ffn_in(x))
            return self.norm2(x + self.drop2(y, training=training))

    return StandardBlock


def build_jax_model(cfg, policy="full", offload=False):
    """Returns (model, loss_fn) for Keras 3 on JAX: the standard blocks decorated with
    `recompute_grad(policy=policy, offload=offload)` in the same encoder as `build_model`'s, and
    `loss_fn(trainable, non_trainable, ids, labels) -> (loss, new non-trainable)` for
    `jax.value_and_grad` (the model's `stateless_call`, training=True)."""
    import keras

    from recompute import recompute_grad

    hidden, seq, vocab, rate = cfg["hidden"], cfg["seq"], cfg["vocab"], cfg["dropout"]
    block_cls = standard_block_class(cfg)
    block_cls.call = recompute_grad(block_cls.call, policy=policy, offload=offload)
    keras.utils.set_random_seed(0)
    ids = keras.Input((seq,), dtype="int32")
    positions = keras.layers.Embedding(seq, hidden, name="positions")(keras.ops.arange(seq)[None])
    x = keras.layers.Embedding(vocab, hidden, name="tokens")(ids) + positions
    x = keras.layers.Dropout(rate)(keras.layers.LayerNormalization(epsilon=1e-12, name="emb_norm")(x))
    for i in range(cfg["layers"]):
        x = block_cls(name=f"block_{i}")(x)
    pooled = keras.layers.Dropout(rate)(keras.layers.Dense(hidden, activation="tanh", name="pool")(x[:, 0]))
    model = keras.Model(ids, keras.layers.Dense(2, name="classifier")(pooled))
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(trainable, non_trainable, ids, labels):
        logits, new_non_trainable = model.stateless_call(trainable, non_trainable, ids, training=True)
        return cross_entropy(labels, logits), new_non_trainable

    return model, loss_fn


def add_shape_arguments(parser, defaults, batch_help, steps_help):
    """The shape options (`SHAPE_KEYS`), `--batch-sizes` and `--steps`; None = take `defaults`."""
    d = defaults
    parser.add_argument("--layers", type=harness.positive_int, help=f"blocks (default {d['layers']})")
    parser.add_argument("--hidden", type=harness.positive_int, help=f"hidden size (default {d['hidden']})")
    parser.add_argument("--heads", type=harness.positive_int, help=f"attention heads (default {d['heads']})")
    parser.add_argument("--ffn", type=harness.positive_int, help=f"FFN inner size (default {d['ffn']})")
    parser.add_argument("--seq", type=harness.positive_int, help=f"sequence length (default {d['seq']})")
    parser.add_argument("--vocab", type=harness.positive_int, help=f"vocabulary size (default {d['vocab']})")
    parser.add_argument("--batch-sizes", type=harness.int_list, help=batch_help)
    parser.add_argument("--steps", type=harness.positive_int, help=f"{steps_help} (default {d['steps']})")
    parser.add_argument("--dropout", type=harness.fraction, help=f"dropout rate (default {d['dropout']})")


def finish_shape_arguments(parser, args, defaults, need_slope):
    """Fills the options left None from `defaults`, checks the shape; with `need_slope`,
    at least two batch sizes (the per-sample memory is a slope)."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if need_slope and len(args.batch_sizes) < 2:
        parser.error("--batch-sizes needs at least two batch sizes (the per-sample memory is a "
                     f"slope); got {','.join(map(str, args.batch_sizes))}")


def shape_config(args):
    """The model's shape from parsed arguments."""
    return {key: getattr(args, key) for key in SHAPE_KEYS}


def shape_argv(cfg):
    """The command-line options that give a worker the shape `cfg`."""
    argv = []
    for key in SHAPE_KEYS:
        argv += [f"--{key}", str(cfg[key])]
    return argv
