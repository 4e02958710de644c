"""Gradient accumulation on real data: batch 1 with `AccumOptimizer(Adam(), k)` trains like batch k.

The classic experiment, on scikit-learn's handwritten digits (8x8 images,
shipped with scikit-learn, no download): an MLP trained

1. with Adam at batch size 1,
2. with `AccumOptimizer(Adam(), k)` at batch size 1,
3. with Adam at batch size k,

from the same initial weights and on the same sample order. Run 2 matches
run 3 (the table shows the same loss and accuracy; the last line gives the
largest weight difference), while run 1 is a different training run.

    python examples/accum_digits.py              # k=8, 5 epochs, ~1 minute on 2 CPU cores
    python examples/accum_digits.py --k 4 --epochs 2 --limit 400

Epochs are 1437 samples, not a multiple of k: each epoch ends with a partial
window, applied by `optimizer.flush_callback()` (normalized by its count, like
the last, smaller batch of run 3).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from accum import AccumOptimizer  # noqa: E402


def load(limit=None, seed=0):
    """Digits scaled to [0, 1], split 80/20 (stratified)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    if limit:
        x_train, y_train = x_train[:limit], y_train[:limit]
    return x_train, y_train, x_test, y_test


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def train(run, k, epochs, data, initial_weights, learning_rate, seed=0):
    """Trains one configuration; returns per-epoch (train loss, test accuracy) and the model."""
    x_train, y_train, x_test, y_test = data
    model = make_model()
    model.set_weights(initial_weights)
    callbacks = []
    if run == "accum":
        optimizer = AccumOptimizer(keras.optimizers.Adam(learning_rate), k)
        callbacks = [optimizer.flush_callback("epoch_end")]
        batch_size = 1
    else:
        optimizer = keras.optimizers.Adam(learning_rate)
        batch_size = 1 if run == "batch1" else k
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    order = np.random.default_rng(seed)
    rows = []
    for _ in range(epochs):
        perm = order.permutation(len(x_train))  # same order for every run
        model.fit(x_train[perm], y_train[perm], batch_size=batch_size, epochs=1,
                  shuffle=False, verbose=0, callbacks=callbacks)
        loss, _ = model.evaluate(x_train, y_train, batch_size=512, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
        rows.append((loss, accuracy))
    return rows, model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=8, help="steps_per_update (default 8)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--limit", type=int, default=None, help="use only this many training samples")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args(argv)

    data = load(args.limit)
    initial = make_model().get_weights()
    results, models = {}, {}
    for run in ("batch1", "accum", "batchk"):
        results[run], models[run] = train(run, args.k, args.epochs, data, initial, args.learning_rate)

    k = args.k
    print(f"digits: {len(data[0])} train / {len(data[2])} test samples, k={k}")
    header = f"{'epoch':>5} | {'Adam b=1':^19} | {f'Accum(Adam,{k}) b=1':^19} | {f'Adam b={k}':^19}"
    print(header)
    print(f"{'':>5} | {'loss':>8} {'test acc':>9} | {'loss':>8} {'test acc':>9} | {'loss':>8} {'test acc':>9}")
    print("-" * len(header))
    for epoch in range(args.epochs):
        cells = " | ".join(
            f"{results[run][epoch][0]:8.5f} {results[run][epoch][1]:9.4f}" for run in ("batch1", "accum", "batchk")
        )
        print(f"{epoch + 1:>5} | {cells}")
    max_diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(models["accum"].get_weights(), models["batchk"].get_weights())
    )
    print(f"max |weights(Accum b=1) - weights(Adam b={k})| = {max_diff:.3g}")
    return results, max_diff


if __name__ == "__main__":
    main()
