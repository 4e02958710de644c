"""Train a small Transformer classifier with `model.fit`, with and without recomputation.

Shows the whole workflow on Keras 3: decorate each block's `call` with
`@recompute_grad`, turn it on with `RECOMPUTE=1` (here with `recompute_scope`
so both runs fit in one script), and check that training is unchanged: the
same seed gives the same losses and the same final weights to float rounding
(the largest difference relative to the largest weight), with dropout on.

    python examples/recompute_fit.py [--blocks 4] [--epochs 2]

The data is synthetic (a sequence is labelled by whether token 1 occurs more
often than token 2), so the script needs no download.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import recompute  # noqa: E402
from recompute import recompute_grad  # noqa: E402


class Block(keras.layers.Layer):
    """A post-norm Transformer encoder block."""

    def __init__(self, hidden, heads, ffn, rate, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=rate)
        self.norm1 = keras.layers.LayerNormalization()
        self.ffn1 = keras.layers.Dense(ffn, activation="gelu")
        self.ffn2 = keras.layers.Dense(hidden)
        self.dropout = keras.layers.Dropout(rate)
        self.norm2 = keras.layers.LayerNormalization()

    @recompute_grad
    def call(self, x, training=None):
        x = self.norm1(x + self.attention(x, x, training=training))
        return self.norm2(x + self.dropout(self.ffn2(self.ffn1(x)), training=training))


def make_data(n, seq, vocab, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(n, seq))
    labels = ((tokens == 1).sum(1) > (tokens == 2).sum(1)).astype("float32")
    return tokens, labels


def build(args):
    keras.utils.set_random_seed(args.seed)
    tokens = keras.Input((args.seq,), dtype="int32")
    h = keras.layers.Embedding(args.vocab, args.hidden)(tokens)
    for _ in range(args.blocks):
        h = Block(args.hidden, args.heads, 4 * args.hidden, args.dropout)(h)
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(tokens, out)
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy", metrics=["accuracy"])
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("blocks", "hidden", "heads", "seq", "vocab", "samples", "batch_size", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.hidden % args.heads:
        parser.error(f"--hidden must be a multiple of --heads. Received: {args.hidden} and {args.heads}")

    x, y = make_data(args.samples, args.seq, args.vocab, args.seed)
    runs = {}
    for on in (False, True):
        print(f"--- RECOMPUTE={int(on)} ---", flush=True)
        model = build(args)
        with recompute.recompute_scope(on):
            hist = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=2)
        runs[on] = (hist.history["loss"], [np.asarray(w) for w in model.weights])

    loss_diff = max(abs(a - b) for a, b in zip(runs[False][0], runs[True][0]))
    # Relative to the model's largest weight: the key projections' biases have an
    # analytically zero gradient, whose float rounding Adam turns into steps of the
    # learning rate's size in both runs -- relative to their own (tiny) size those
    # differ by rounding made large, not by a difference in training.
    scale = max(float(np.max(np.abs(a))) for a in runs[False][1])
    weight_diff = max(
        float(np.max(np.abs(a - b))) / max(scale, 1e-12)
        for a, b in zip(runs[False][1], runs[True][1])
    )
    print(f"max |loss difference| per epoch: {loss_diff:.3g}")
    print(f"max relative weight difference after training: {weight_diff:.3g}")
    return 0 if weight_diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
