"""Fewer updates, better? Adam at a small batch, moving the weights only every k-th step.

The experiment of "hidden in the momentum" (Su Jianlin): when a small batch is
the bottleneck, keep Adam's moving averages running at every step with their
usual β but move the weights only every k-th step -- does that train better
than moving them at every step? On scikit-learn's handwritten digits (shipped
with scikit-learn, no download), the MLP of `examples/accum_digits.py`
trained with Adam at a small batch `b` in four arms, all from the same initial
weights and on the same sample order for a given seed:

a. every step: Adam at batch `b`, the weights move at every step.
b. every k-th step, β unchanged: Adam's moments are updated at every micro-step
   with the original β (0.9, 0.999), the weights move at every k-th one.
c. `AccumOptimizer(Adam(), k, mode="rescale")`: the same, with each β
   replaced by β̃ = 1 − (1 − β)/k (close to Adam at batch k·b).
d. `AccumOptimizer(Adam(), k)` (`mode="buffer"`): exactly Adam at batch k·b.

The learning rate per update is the same in every arm, so arms b-d make k
times fewer updates than arm a in the same epochs.

Arm b is `mode="rescale"` around `Adam(beta_1=β₁', beta_2=β₂')` with
β' = 1 − k(1 − β): rescale runs the inner optimizer at every micro-step with
1 − (1 − β')/k = β, the original coefficient, and bias corrections 1 − βⁿ
(n: micro-steps), and moves the weights at every k-th micro-step only. β' must
be in [0, 1], so k ≤ 1/(1 − β₁) (10 for β₁ = 0.9); a larger k is refused with
an error (see `unchanged_beta_adam`).

Epochs are not a multiple of k micro-steps in general (1437 samples). Arm d
applies each epoch's partial window at the epoch end (`flush_callback`, as the
last, smaller batch of batch k·b); `mode="rescale"` cannot flush, so in arms b
and c a partial window at an epoch end just carries on into the next epoch
(its micro-steps are already in the moments; the weights move at the window's
end).

    python examples/fewer_updates.py      # b=1, k=8, 5 seeds x 10 epochs: ~6 minutes on 2 CPU cores
    python examples/fewer_updates.py --seeds 2 --epochs 2 --limit 300 --out-png /tmp/f.png
    python examples/fewer_updates.py --json results.json --out-png docs/fewer_updates.png

Prints a line per seed and arm as it goes (stderr), then per arm the mean ±
std (over seeds, n − 1), min and max of held-out accuracy and loss after the
last epoch, as a Markdown table; writes a PNG of held-out accuracy against
epoch (mean, shaded ± std) and, with `--json`, every per-epoch figure.
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # accum_digits: data and model
import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum import AccumOptimizer  # noqa: E402
from accum_digits import load, make_model  # noqa: E402

ARMS = ("every_step", "every_kth", "rescale", "buffer")
# Fit runs this many micro-steps per call into TensorFlow (same results, less overhead).
STEPS_PER_EXECUTION = 64


def labels(k, b):
    """{arm: its label in the table and the figure}."""
    return {
        "every_step": f"a. Adam b={b}, every step",
        "every_kth": f"b. Adam b={b}, every {k}th step, β unchanged",
        "rescale": f'c. Accum(Adam, {k}, "rescale") b={b}',
        "buffer": f'd. Accum(Adam, {k}, "buffer") b={b} (= Adam b={k * b})',
    }


def unchanged_beta_adam(k, learning_rate, beta_1=0.9, beta_2=0.999):
    """Arm b: an optimizer that updates Adam's moments at every micro-step with the
    original `beta_1`, `beta_2`, and moves the weights at every `k`-th micro-step.

    `AccumOptimizer(Adam(beta_1=β₁', beta_2=β₂'), k, mode="rescale")` with
    β' = 1 − k(1 − β), which `mode="rescale"` maps back to 1 − (1 − β')/k = β.
    Raises `ValueError` if some β' is below 0 (k > 1/(1 − β)).
    """
    inner = {}
    for name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
        value = 1.0 - k * (1.0 - beta)
        if abs(value) < 1e-12:  # k = 1/(1 − β) up to rounding
            value = 0.0
        if value < 0.0:
            raise ValueError(
                f"k={k} is too large to keep {name}={beta} unchanged with mode=\"rescale\": the "
                f"inner optimizer would need {name} = 1 - k*(1 - {name}) = {value:.4g}, below 0. "
                f"Use k <= {math.floor(1.0 / (1.0 - beta) + 1e-9)} (k <= 1/(1 - {name}))."
            )
        inner[name] = value
    return AccumOptimizer(keras.optimizers.Adam(learning_rate, **inner), k, mode="rescale")


def make_optimizer(arm, k, learning_rate):
    """The optimizer of `arm` and the callbacks `fit` needs with it."""
    if arm == "every_step":
        return keras.optimizers.Adam(learning_rate), []
    if arm == "every_kth":
        return unchanged_beta_adam(k, learning_rate), []
    optimizer = AccumOptimizer(keras.optimizers.Adam(learning_rate), k, mode=arm)
    return optimizer, ([optimizer.flush_callback("epoch_end")] if arm == "buffer" else [])


def train(arm, args, data, initial_weights, orders):
    """Trains one arm from `initial_weights` on the sample orders `orders` (one per
    epoch); returns held-out accuracy and loss before training and after each epoch."""
    x_train, y_train, x_test, y_test = data
    model = make_model()
    model.set_weights(initial_weights)
    optimizer, callbacks = make_optimizer(arm, args.k, args.lr)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=STEPS_PER_EXECUTION,
    )

    history = {"accuracy": [], "loss": []}

    def evaluate():
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
        history["accuracy"].append(float(accuracy))
        history["loss"].append(float(loss))

    evaluate()
    for perm in orders:
        model.fit(x_train[perm], y_train[perm], batch_size=args.batch_size, epochs=1,
                  shuffle=False, verbose=0, callbacks=callbacks)
        evaluate()
    return history


def summary(values):
    """Mean, std (n − 1; 0 for one value), min and max of `values`."""
    values = np.asarray(values, dtype=float)
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(np.mean(values)), "std": std,
            "min": float(np.min(values)), "max": float(np.max(values))}


def run(args, progress=None):
    """All arms for seeds 0..seeds-1; returns {arm: [history per seed]}."""
    progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    data = load(args.limit)
    steps = math.ceil(len(data[0]) / args.batch_size)
    progress(f"digits: {len(data[0])} train / {len(data[2])} held-out samples, b={args.batch_size}, "
             f"k={args.k}, lr={args.lr:g}, {args.epochs} epochs of {steps} micro-steps")
    names = labels(args.k, args.batch_size)
    results = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        initial = make_model(seed).get_weights()
        rng = np.random.default_rng(seed)
        orders = [rng.permutation(len(data[0])) for _ in range(args.epochs)]
        for arm in ARMS:
            start = time.perf_counter()
            history = train(arm, args, data, initial, orders)
            results[arm].append(history)
            progress(f"seed {seed} {names[arm]}: held-out acc {history['accuracy'][-1]:.4f}, "
                     f"loss {history['loss'][-1]:.4f} ({time.perf_counter() - start:.1f} s)")
    return results


def table(results, args):
    """The Markdown table of held-out accuracy and loss after the last epoch."""
    names = labels(args.k, args.batch_size)
    lines = [
        "| arm | held-out accuracy, mean ± std | min – max | held-out loss, mean ± std | min – max |",
        "|---|---|---|---|---|",
    ]
    for arm in ARMS:
        acc = summary([h["accuracy"][-1] for h in results[arm]])
        loss = summary([h["loss"][-1] for h in results[arm]])
        lines.append(
            f"| {names[arm]} | {acc['mean']:.4f} ± {acc['std']:.4f} | {acc['min']:.4f} – {acc['max']:.4f} "
            f"| {loss['mean']:.4f} ± {loss['std']:.4f} | {loss['min']:.4f} – {loss['max']:.4f} |"
        )
    return "\n".join(lines)


def plot(results, args, path):
    """Writes the PNG: held-out accuracy after each epoch per arm, mean with a ± std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = labels(args.k, args.batch_size)
    epochs = np.arange(1, args.epochs + 1)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    low = 1.0
    for arm in ARMS:
        curves = np.array([h["accuracy"][1:] for h in results[arm]])  # after each epoch
        mean = curves.mean(axis=0)
        std = curves.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        (line,) = ax.plot(epochs, mean, marker=".", label=names[arm])
        ax.fill_between(epochs, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        low = min(low, float(np.min(mean - std)))
    ax.set_xlabel("epoch")
    ax.set_xticks(epochs)
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"digits MLP, Adam lr={args.lr:g}, b={args.batch_size}, k={args.k}: "
                 f"mean ± std over {args.seeds} seeds", fontsize=10)
    ax.set_ylim(max(0.0, low - 0.02), 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _positive(convert, expected):
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def parse_args(argv=None):
    """The command line; checks that k can keep β₁ unchanged and that output folders exist."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive_int = _positive(int, "a positive integer")
    parser.add_argument("--k", type=positive_int, default=8, help="micro-steps per update (default 8, at most 10)")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="micro-batch size b (default 1)")
    parser.add_argument("--lr", type=_positive(float, "a positive number"), default=3e-3,
                        help="Adam's learning rate, the same per update in every arm (default 3e-3)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="default 10")
    parser.add_argument("--seeds", type=positive_int, default=5,
                        help="seeds 0..N-1: initial weights and sample order (default 5)")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only this many training samples")
    parser.add_argument("--out-png", default="fewer_updates.png", help="figure path (default fewer_updates.png)")
    parser.add_argument("--json", help="also write the settings and every per-epoch figure to this file")
    args = parser.parse_args(argv)
    try:
        unchanged_beta_adam(args.k, args.lr)
    except ValueError as e:
        parser.error(f"--k: {e}")
    for flag, path in (("--out-png", args.out_png), ("--json", args.json)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag}: directory {os.path.dirname(os.path.abspath(path))!r} does not exist")
    return args


def main(argv=None):
    """Runs the experiment; prints the table, writes the PNG (and JSON); returns the results."""
    args = parse_args(argv)
    start = time.perf_counter()
    results = run(args)
    report = table(results, args)
    print(f"digits MLP, Adam lr={args.lr:g}, b={args.batch_size}, k={args.k}, {args.epochs} epochs, "
          f"seeds 0..{args.seeds - 1}: held-out figures after the last epoch")
    print(report)
    plot(results, args, args.out_png)
    print(f"figure: {args.out_png}; {time.perf_counter() - start:.0f} s")
    if args.json:
        names = labels(args.k, args.batch_size)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({
                "settings": {key: getattr(args, key) for key in ("k", "batch_size", "lr", "epochs", "seeds", "limit")},
                "arms": {
                    arm: {
                        "label": names[arm],
                        "final_accuracy": summary([h["accuracy"][-1] for h in results[arm]]),
                        "final_loss": summary([h["loss"][-1] for h in results[arm]]),
                        "per_seed": results[arm],
                    }
                    for arm in ARMS
                },
            }, f, indent=1)
    return results


if __name__ == "__main__":
    main()
