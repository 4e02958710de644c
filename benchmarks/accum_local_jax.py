"""Benchmark: `accum.local_gradients` against Keras's step on virtual JAX CPU devices.

    python -m benchmarks.accum_local_jax                 # 8 devices, MLP of 4.2M parameters, k=8
    python -m benchmarks.accum_local_jax --quick         # 4 devices, 0.1M parameters, k=4
    python -m benchmarks.accum_local_jax --devices 8 --width 2048 --k 8 --updates 12

One worker process (`XLA_FLAGS=--xla_force_host_platform_device_count=<devices>`,
`KERAS_BACKEND=jax`) trains the same MLP (`--layers` Dense layers of `--width`,
tanh, MSE) under `keras.distribution.DataParallel` over every device, with
`AccumOptimizer(Adam, k)` and a global micro-batch of `--micro-batch` per device
times the devices, two ways:

- `keras`: Keras's JAX train step: XLA all-reduces every gradient in every
  micro-step (k all-reduces of the parameters per update);
- `local`: `accum.local_gradients(model)`: each device adds its gradients to its
  own row of the buffers; one all-reduce of the parameters per update, inside
  the update's `jax.lax.cond`.

It counts the all-reduces of each compiled train step (`tests.helpers.hlo`:
float elements reduced on every micro-step and only on update steps) and
times `--updates` updates of k `train_on_batch` calls each, after one update of
warm-up, the two ways alternating update by update (paired rounds: load from
other work hits both alike); wall and CPU seconds per update, medians, and the
median of the rounds' ratios. Both ways start from the same weights; the
final weights are compared (they train alike to float rounding).

Limits: virtual devices are threads of one process sharing this machine's
cores and memory, and their all-reduce is a memory copy, so the time saved
here is a lower bound of what an interconnect between accelerators saves;
the traffic (elements per update) is what carries over.
"""

import json
import os
import statistics
import sys
import time

from benchmarks import harness

TOOL = "benchmarks.accum_local_jax"
progress = harness.Progress(TOOL)
WAYS = ("keras", "local")


def parse_args(argv=None):
    p = harness.parser(TOOL, __doc__.split("\n\n")[0])
    p.add_argument("--devices", type=harness.positive_int, default=8, help="virtual CPU devices (default 8)")
    p.add_argument("--layers", type=harness.positive_int, default=4, help="Dense layers (default 4)")
    p.add_argument("--width", type=harness.positive_int, default=1024, help="their width (default 1024)")
    p.add_argument("--micro-batch", type=harness.positive_int, default=4,
                   help="samples per device per micro-step (default 4)")
    p.add_argument("--k", type=harness.positive_int, default=8, help="steps_per_update (default 8)")
    p.add_argument("--updates", type=harness.positive_int, default=10, help="timed updates per way (default 10)")
    p.add_argument("--quick", action="store_true", help="4 devices, 2 layers of 128, k=4, 3 updates")
    p.add_argument("--timeout", type=harness.positive_float, default=1800.0,
                   help="seconds before the worker is killed (default 1800)")
    harness.add_output_arguments(p, TOOL)
    args = p.parse_args(argv)
    if args.quick:
        args.devices, args.layers, args.width, args.k, args.updates = 4, 2, 128, 4, 3
    harness.check_json_folder(p, args)
    if args.docs:
        harness.check_docs_page(p, args.docs, TOOL)
    return args


# ------------------------------------------------------------------ worker

def worker(args):
    import jax
    import keras
    import numpy as np

    import accum
    import recompute
    from tests.helpers import hlo

    recompute.exact_float32()
    devices = jax.devices()
    assert len(devices) == args.devices, devices
    batch = args.micro_batch * args.devices
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * args.k * (args.updates + 1), args.width)).astype("float32")
    y = rng.normal(size=(len(x), args.width)).astype("float32")

    def build(way):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((args.width,))]
        layers += [keras.layers.Dense(args.width, activation="tanh") for _ in range(args.layers)]
        model = keras.Sequential(layers)
        model.compile(accum.AccumOptimizer(keras.optimizers.Adam(1e-4), args.k), "mse")
        if way == "local":
            accum.local_gradients(model)
        return model

    with keras.distribution.DataParallel(devices=devices).scope():
        models = {way: build(way) for way in WAYS}
        parameters = models["keras"].count_params()
        reductions = {}
        for way, model in models.items():
            ops = hlo.all_reduces(hlo.compiled_train_step_text(model, x[:batch], y[:batch]))
            reductions[way] = {
                "every_step_floats": sum(o.elements for o in ops if o.floats and not o.conditional),
                "update_only_floats": sum(o.elements for o in ops if o.floats and o.conditional),
            }
        progress(f"{parameters} parameters, {args.devices} devices, micro-batch {batch}, k={args.k}")
        times = {way: {"wall": [], "cpu": []} for way in WAYS}
        for update in range(args.updates + 1):
            for way, model in models.items():
                start, cpu = time.perf_counter(), time.process_time()
                for step in range(args.k):
                    i = (update * args.k + step) * batch
                    model.train_on_batch(x[i:i + batch], y[i:i + batch])
                jax.block_until_ready([v.value for v in model.trainable_variables])
                if update:  # the first is warm-up (compilation)
                    times[way]["wall"].append(time.perf_counter() - start)
                    times[way]["cpu"].append(time.process_time() - cpu)
            if update:
                progress(f"update {update}/{args.updates}: " + ", ".join(
                    f"{way} {times[way]['wall'][-1]:.3f} s" for way in WAYS))
        difference = max(
            float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
            for a, b in zip(models["keras"].get_weights(), models["local"].get_weights()))
    harness.write_result(args.out, {
        "parameters": parameters, "batch": batch, "reductions": reductions, "times": times,
        "weights_max_rel_difference": difference, "jax": jax.__version__, "keras": keras.__version__,
    })


# ------------------------------------------------------------------ parent

def report(args, result):
    k, times = args.k, result["times"]
    print(f"MLP {args.layers} x {args.width} ({result['parameters']:,} parameters), DataParallel over "
          f"{args.devices} virtual CPU devices, global micro-batch {result['batch']}, "
          f"AccumOptimizer(Adam, {k}); jax {result['jax']}, keras {result['keras']}; "
          f"{args.updates} updates per way, alternating")
    print()
    print("| step | floats all-reduced per micro-step | on update steps only | per update | "
          "wall s / update | CPU s / update |")
    print("|---|---|---|---|---|---|")
    for way in WAYS:
        r = result["reductions"][way]
        per_update = r["every_step_floats"] * k + r["update_only_floats"]
        print(f"| {way} | {r['every_step_floats']:,} | {r['update_only_floats']:,} | {per_update:,} | "
              f"{statistics.median(times[way]['wall']):.3f} | {statistics.median(times[way]['cpu']):.3f} |")
    ratios = [a / b for a, b in zip(times["local"]["wall"], times["keras"]["wall"])]
    cpu_ratios = [a / b for a, b in zip(times["local"]["cpu"], times["keras"]["cpu"])]
    print()
    print(f"local / keras, median of the rounds: wall {statistics.median(ratios):.3f}, "
          f"CPU {statistics.median(cpu_ratios):.3f}; final weights differ by "
          f"{result['weights_max_rel_difference']:.1e} (relative)")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    env = {"KERAS_BACKEND": "jax", "CUDA_VISIBLE_DEVICES": "",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()}
    worker_argv = [f"--devices={args.devices}", f"--layers={args.layers}", f"--width={args.width}",
                   f"--micro-batch={args.micro_batch}", f"--k={args.k}", f"--updates={args.updates}"]
    runs = harness.run_workers(progress, worker_argv, [env], timeout=args.timeout)
    try:
        (result,) = harness.require_results(runs, TOOL, args.timeout)
    except RuntimeError as e:  # its stderr tail is printed already
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    with harness.report_to_docs(args.docs, TOOL, argv):
        report(args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main()
