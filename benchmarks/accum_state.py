"""Benchmark: optimizer-state bytes and time per micro-step of `AccumOptimizer` (Keras 3).

    python -m benchmarks.accum_state            # BERT-base-sized parameter set (110M), k=8
    python -m benchmarks.accum_state --quick    # 1/16 of the hidden sizes' parameters, a few seconds
    python -m benchmarks.accum_state --json out.json

Measured in one run, on one parameter set (the shapes of BERT-base's
weights, or a scaled-down copy with `--quick`), with fixed random dense
gradients:

- optimizer-state bytes of plain Adam, `AccumOptimizer(Adam(), k)`
  (`mode="buffer"`), `mode="momentum"` and Keras's built-in
  `Adam(gradient_accumulation_steps=k)`;
- time per micro-step (one `apply_gradients` call inside `tf.function`) of
  each, and its ratio to plain Adam's (which updates at every step). Timings
  are interleaved over rounds and the median is reported, so a machine shared
  with other jobs affects every configuration alike.

This times the optimizer only (what the wrapper adds), not a model's forward
and backward pass, which a real training step adds to every configuration.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum import AccumOptimizer  # noqa: E402

from . import harness  # noqa: E402


def bert_shapes(hidden=768, layers=12, ffn=3072, vocab=30522, positions=512):
    """The weight shapes of a BERT encoder (embeddings, `layers` blocks, pooler)."""
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,)]  # attention LayerNorm
        shapes += [(hidden, ffn), (ffn,), (ffn, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,)]  # output LayerNorm
    shapes += [(hidden, hidden), (hidden,)]  # pooler
    return shapes


def n_params(shapes):
    return int(sum(np.prod(s) for s in shapes))


def state_bytes(optimizer):
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in optimizer.variables))


TOOL = "benchmarks.accum_state"
CONFIGS = ("plain", "buffer", "momentum", "keras_builtin")


def make_optimizer(config, k, learning_rate=1e-4):
    if config == "plain":
        return keras.optimizers.Adam(learning_rate)
    if config == "buffer":
        return AccumOptimizer(keras.optimizers.Adam(learning_rate), k)
    if config == "momentum":
        return AccumOptimizer(keras.optimizers.Adam(learning_rate), k, mode="momentum")
    return keras.optimizers.Adam(learning_rate, gradient_accumulation_steps=k)


def run(shapes, k, windows, rounds, jit_compile=False):
    """Returns {config: {"state_bytes", "seconds_per_micro_step"}}."""
    rng = tf.random.Generator.from_seed(0)
    variables = [keras.Variable(rng.normal(s) * 0.02, name=f"w{i}") for i, s in enumerate(shapes)]
    grads = [rng.normal(s) * 1e-3 for s in shapes]
    steps = {}
    results = {}
    for config in CONFIGS:
        optimizer = make_optimizer(config, k)
        optimizer.build(variables)

        def step(optimizer=optimizer):
            optimizer.apply_gradients(zip(grads, variables))

        steps[config] = (optimizer, tf.function(step, jit_compile=jit_compile))
        results[config] = {"state_bytes": state_bytes(optimizer), "times": []}
    for _, fn in steps.values():  # trace and warm up: one window
        for _ in range(k):
            fn()
    n = windows * k
    for _ in range(rounds):
        for config, (optimizer, fn) in steps.items():
            _ = variables[0].numpy()[0, 0]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            _ = variables[0].numpy()[0, 0]  # wait for the last update
            results[config]["times"].append((time.perf_counter() - start) / n)
    for config in CONFIGS:
        times = results[config].pop("times")
        results[config]["seconds_per_micro_step"] = statistics.median(times)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accum_state",
                                     description="AccumOptimizer state bytes and micro-step time.")
    parser.add_argument("--quick", action="store_true", help="1/16-size parameter set, fewer rounds")
    parser.add_argument("--k", type=harness.positive_int, default=8, help="steps_per_update (default 8)")
    parser.add_argument("--windows", type=harness.positive_int, default=2, help="windows timed per round")
    parser.add_argument("--rounds", type=harness.positive_int, default=5)
    parser.add_argument("--jit", action="store_true", help="jit_compile the step")
    harness.add_output_arguments(parser, TOOL, workers=False)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)

    if args.quick:
        shapes = bert_shapes(hidden=192, layers=12, ffn=768, vocab=7680)
        rounds = min(args.rounds, 3)
    else:
        shapes = bert_shapes()
        rounds = args.rounds
    params = n_params(shapes)
    results = run(shapes, args.k, args.windows, rounds, args.jit)
    base = results["plain"]
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(f"parameters: {params / 1e6:.1f}M ({'quick' if args.quick else 'BERT-base'} shapes), "
              f"k={args.k}, {rounds} rounds x {args.windows * args.k} micro-steps, jit={args.jit}")
        print(f"{'optimizer':<34} {'state MiB':>10} {'vs plain':>9} {'ms/micro-step':>14} {'ratio':>7}")
        labels = {
            "plain": "Adam",
            "buffer": f"AccumOptimizer(Adam, {args.k})",
            "momentum": f"AccumOptimizer(Adam, {args.k}, 'momentum')",
            "keras_builtin": f"Adam(gradient_accumulation_steps={args.k})",
        }
        for config in CONFIGS:
            r = results[config]
            r["state_vs_plain_bytes"] = r["state_bytes"] - base["state_bytes"]
            r["time_ratio"] = r["seconds_per_micro_step"] / base["seconds_per_micro_step"]
            print(f"{labels[config]:<34} {r['state_bytes'] / harness.MiB:10.1f} "
                  f"{r['state_vs_plain_bytes'] / harness.MiB:+9.1f} {1e3 * r['seconds_per_micro_step']:14.2f} "
                  f"{r['time_ratio']:7.3f}")
        saved = results["buffer"]["state_bytes"] - results["momentum"]["state_bytes"]
        large = n_params(bert_shapes(hidden=1024, layers=24, ffn=4096))
        print(f"momentum mode saves {saved / 2**30:.2f} GiB here (one float32 copy of the parameters); "
              f"BERT-base {n_params(bert_shapes()) * 4 / 2**30:.2f} GiB, BERT-large {large * 4 / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"parameters": params, "k": args.k, "jit": args.jit, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
