"""Benchmark: how far each `AccumOptimizer` mode ends from the inner optimizer at batch k·b.

    python -m benchmarks.accum_modes                      # k=8, b=4, 5 epochs, ~2 minutes on 2 CPU cores
    python -m benchmarks.accum_modes --optimizers Adam,SGD --epochs 2
    python -m benchmarks.accum_modes --docs docs/rescale.md --json modes.json

On scikit-learn's digits and the MLP of `examples/accum_digits.py`, from one
set of initial weights and on one fixed sample order, for each inner
optimizer (SGD with momentum 0.9, Adam, AdamW, Nadam, RMSprop with momentum
0.9, Lion) it trains

- the reference: the inner optimizer at batch k·b;
- the rounding floor: the same with each batch's samples in reverse order
  (the same mean gradients, rounded otherwise): how far float32 rounding
  alone moves a run from the reference, more where training amplifies a
  tiny difference (SGD with momentum here);
- `AccumOptimizer(inner, k, mode=...)` at batch b for `mode="buffer"`,
  `"momentum"` (which refuses some optimizers: the table says "refused" and
  the error's first words) and `"rescale"`;
- the inner optimizer at batch b, updating at every step (for scale: what
  not accumulating at all gives).

The training set is cut to a multiple of k·b samples (1437 -> 1408 for
k·b = 32), so every epoch is whole windows (`mode="rescale"` has no flush).
For each run the table gives the relative weight distance
‖w − w_ref‖ / ‖w_ref − w₀‖ (all weights as one vector; w₀ the initial
weights) and the held-out accuracy and loss, with their differences from the
reference's. The learning rates are in `OPTIMIZERS`.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum import AccumOptimizer  # noqa: E402

from . import harness  # noqa: E402

sys.path.insert(0, os.path.join(harness.CHECKOUT, "examples"))  # the digits data and model
from accum_digits import load, make_model  # noqa: E402

TOOL = "benchmarks.accum_modes"
# name -> (Keras class, constructor arguments): the inner optimizers.
OPTIMIZERS = {
    "SGD": ("SGD", dict(learning_rate=0.01, momentum=0.9)),
    "Adam": ("Adam", dict(learning_rate=1e-3)),
    "AdamW": ("AdamW", dict(learning_rate=1e-3, weight_decay=0.01)),
    "Nadam": ("Nadam", dict(learning_rate=1e-3)),
    "RMSprop": ("RMSprop", dict(learning_rate=1e-4, momentum=0.9)),
    "Lion": ("Lion", dict(learning_rate=3e-4)),
}
RUNS = ("reference", "rounding", "buffer", "momentum", "rescale", "plain")
STEPS_PER_EXECUTION = 64  # micro-steps per call into TensorFlow (same results, less overhead)


def make_inner(name):
    """A fresh inner optimizer `name` of `OPTIMIZERS`."""
    cls, kwargs = OPTIMIZERS[name]
    return getattr(keras.optimizers, cls)(**kwargs)


def train(optimizer, batch_size, data, initial_weights, orders):
    """Trains the digits MLP from `initial_weights` with `optimizer` on the sample
    orders `orders` (one per epoch); returns (weights as one vector, held-out
    accuracy, held-out loss)."""
    x_train, y_train, x_test, y_test = data
    model = make_model()
    model.set_weights(initial_weights)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=STEPS_PER_EXECUTION)
    for perm in orders:
        model.fit(x_train[perm], y_train[perm], batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    return flat(model.get_weights()), float(accuracy), float(loss)


def flat(weights):
    """A list of arrays as one float64 vector."""
    return np.concatenate([np.ravel(w).astype("float64") for w in weights])


def refusal(error, words=9):
    """The first `words` words of an error message."""
    parts = str(error).split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


def measure(name, k, batch_size, data, initial_weights, orders, progress):
    """{run: {"distance", "accuracy", "loss"} or {"refused"}} for one inner optimizer."""
    w0 = flat(initial_weights)
    window = k * batch_size
    reversed_orders = [order.reshape(-1, window)[:, ::-1].ravel() for order in orders]
    results = {}
    for run in RUNS:
        start = time.perf_counter()
        if run in ("reference", "rounding"):
            optimizer, b = make_inner(name), window
        elif run == "plain":
            optimizer, b = make_inner(name), batch_size
        else:
            b = batch_size
            try:
                optimizer = AccumOptimizer(make_inner(name), k, mode=run)
            except ValueError as e:
                results[run] = {"refused": refusal(e)}
                progress(f"{name} {run}: refused")
                continue
        weights, accuracy, loss = train(optimizer, b, data, initial_weights,
                                        reversed_orders if run == "rounding" else orders)
        results[run] = {"weights": weights, "accuracy": accuracy, "loss": loss}
        progress(f"{name} {run} (batch {b}): held-out acc {accuracy:.4f}, loss {loss:.4f} "
                 f"({time.perf_counter() - start:.1f} s)")
    ref = results["reference"]["weights"]
    scale = np.linalg.norm(ref - w0)
    for result in results.values():
        if "weights" in result:
            result["distance"] = float(np.linalg.norm(result.pop("weights") - ref) / scale)
    return results


def report(results, k, batch_size):
    """Prints the Markdown table of every optimizer's runs."""
    labels = {
        "reference": f"inner, batch {k * batch_size} (reference)",
        "rounding": f"inner, batch {k * batch_size}, samples reversed in each batch",
        "buffer": f'"buffer", batch {batch_size}',
        "momentum": f'"momentum", batch {batch_size}',
        "rescale": f'"rescale", batch {batch_size}',
        "plain": f"inner, batch {batch_size}, every step",
    }
    print("| optimizer | run | ‖w − w_ref‖ / ‖w_ref − w₀‖ "
          "| held-out acc | Δ acc | held-out loss | Δ loss |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        ref = runs["reference"]
        for run in RUNS:
            r = runs[run]
            if "refused" in r:
                print(f"| {name} | {labels[run]} | refused: {r['refused']} | | | | |")
                continue
            print(f"| {name} | {labels[run]} | {r['distance']:.2e} | {r['accuracy']:.4f} "
                  f"| {r['accuracy'] - ref['accuracy']:+.4f} | {r['loss']:.4f} | {r['loss'] - ref['loss']:+.4f} |")


def main(argv=None):
    """Runs the benchmark; prints the table (and writes `--json`, `--docs`); returns the results."""
    parser = argparse.ArgumentParser(prog=f"python -m {TOOL}",
                                     description="How far each AccumOptimizer mode ends from batch k*b.")
    parser.add_argument("--k", type=harness.positive_int, default=8, help="steps_per_update (default 8)")
    parser.add_argument("--batch-size", type=harness.positive_int, default=4, help="micro-batch size b (default 4)")
    parser.add_argument("--epochs", type=harness.positive_int, default=5, help="default 5")
    parser.add_argument("--optimizers", type=harness.name_list(tuple(OPTIMIZERS)), default=tuple(OPTIMIZERS),
                        help=f"comma-separated, from {','.join(OPTIMIZERS)} (default all)")
    harness.add_output_arguments(parser, TOOL, workers=False)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)
    harness.check_json_folder(parser, args)
    progress = harness.Progress(TOOL)

    x_train, y_train, x_test, y_test = load()
    window = args.k * args.batch_size
    n = len(x_train) // window * window
    if n == 0:
        parser.error(f"k * batch size = {window} is more than the {len(x_train)} training samples")
    data = (x_train[:n], y_train[:n], x_test, y_test)
    initial = make_model(0).get_weights()
    rng = np.random.default_rng(0)
    orders = [rng.permutation(n) for _ in range(args.epochs)]
    start = time.perf_counter()
    results = {name: measure(name, args.k, args.batch_size, data, initial, orders, progress)
               for name in args.optimizers}
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(f"digits MLP: {n} train / {len(x_test)} held-out samples, k={args.k}, b={args.batch_size}, "
              f"{args.epochs} epochs, one fixed sample order; learning rates: "
              + ", ".join(f"{name} {OPTIMIZERS[name][1]['learning_rate']:g}" for name in args.optimizers))
        print()
        report(results, args.k, args.batch_size)
    progress(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"k": args.k, "batch_size": args.batch_size, "epochs": args.epochs,
                       "optimizers": {name: OPTIMIZERS[name][1] for name in args.optimizers},
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
