"""Memory/time benchmark of `recompute_grad` on a BERT-base-shaped Keras 3 encoder.

    python -m recompute.benchmark            # full size: 12 x 768, seq 512 (slow)
    python -m recompute.benchmark --quick    # tiny shape, for CI
    python -m recompute.benchmark --layers 4 --seq 256 --json out.json

Every configuration (RECOMPUTE=0 or 1, one batch size) runs in a fresh
subprocess (`python -m recompute.benchmark --worker ...`), which builds the
model, traces and warms up one compiled training step (`tf.function` with a
`GradientTape` and `optimizer.apply`), and then measures:

- activation memory: TensorFlow's CPU allocator peak during a step minus the
  allocator's `current` bytes just before it (stats reset before the step),
  the median over `--steps` steps after two warm-up steps;
- peak RSS of the process (VmHWM);
- CPU seconds per step (`time.process_time`, all threads), mean of those steps.

Per-sample activation memory is the slope between the batch sizes (fixed costs
such as gradients and optimizer temporaries cancel). The parent prints a table
and the ratios: per-sample memory off/on, CPU time per step on/off.
Progress goes to stderr; `--json PATH` saves the results.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

MiB = 1024.0 * 1024.0

FULL = dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522,
            batch_sizes=(2, 6), steps=3, dropout=0.1)
QUICK = dict(layers=3, hidden=256, heads=4, ffn=1024, seq=128, vocab=1000,
             batch_sizes=(2, 6), steps=2, dropout=0.1)
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "seq", "vocab", "dropout")
PREFIX = "[recompute.benchmark]"


def _progress(message):
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# The model (built in the worker processes only).


def build_model(cfg):
    """Returns (model, optimizer, train_step) for the configuration `cfg`."""
    import keras
    import tensorflow as tf

    from recompute import recompute_grad

    hidden, heads, ffn = cfg["hidden"], cfg["heads"], cfg["ffn"]
    seq, vocab, rate = cfg["seq"], cfg["vocab"], cfg["dropout"]
    head_dim = hidden // heads

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

        @recompute_grad
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

    class Encoder(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(vocab, hidden, name="tokens")
            self.positions = keras.layers.Embedding(seq, hidden, name="positions")
            self.norm = keras.layers.LayerNormalization(epsilon=1e-12, name="emb_norm")
            self.drop = Dropout(rate)
            self.blocks = [Block(name=f"block_{i}") for i in range(cfg["layers"])]
            self.pool = keras.layers.Dense(hidden, activation="tanh", name="pool")
            self.head_drop = Dropout(rate)
            self.classifier = keras.layers.Dense(2, name="classifier")

        def call(self, ids, training=None):
            x = self.tokens(ids) + self.positions(tf.range(tf.shape(ids)[1]))[None]
            x = self.drop(self.norm(x), training=training)
            for block in self.blocks:
                x = block(x, training=training)
            pooled = self.head_drop(self.pool(x[:, 0]), training=training)
            return self.classifier(pooled)

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

    keras.utils.set_random_seed(0)
    model = Encoder()
    model(tf.zeros([1, seq], tf.int32), training=False)
    optimizer = FusedAdam(1e-4)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(ids, labels):
        with tf.GradientTape() as tape:
            logits = model(ids, training=True)
            loss = loss_fn(labels, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return model, optimizer, train_step


# --------------------------------------------------------------------------
# Worker: one configuration, one process.


def _vm_hwm_kib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def run_worker(cfg, batch, steps, out_path):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    import recompute

    mode = os.environ.get(recompute.ENV_VAR, "")
    tag = f"RECOMPUTE={mode} batch={batch}"
    _progress(f"{tag}: building the model")
    model, _, train_step = build_model(cfg)
    n_params = int(sum(int(tf.size(v)) for v in model.trainable_variables))

    # A fresh random batch (random labels) for every step: the loss stays
    # near log(2) instead of collapsing on a memorised batch.
    rng = tf.random.Generator.from_seed(batch)
    batches = [
        (rng.uniform([batch, cfg["seq"]], 0, cfg["vocab"], dtype=tf.int32),
         rng.uniform([batch], 0, 2, dtype=tf.int32))
        for _ in range(steps + 2)
    ]

    t0 = time.process_time()
    train_step(*batches[0]).numpy()  # trace + first step (creates the buffers)
    _progress(f"{tag}: traced and ran the first step in "
              f"{time.process_time() - t0:.1f} CPU s; warming up")
    train_step(*batches[1]).numpy()
    _progress(f"{tag}: measuring {steps} step(s)")

    # Each measured step: allocator stats reset just before it; its activation
    # memory is the allocator's peak during the step minus what was in use
    # before it. It varies from step to step by a few percent (the executor's
    # op order and the allocator's reuse of free chunks vary): the median is
    # reported, every step's value is in the JSON.
    activations, cpu, wall, losses = [], [], [], []
    for ids, labels in batches[2:]:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        c0, w0 = time.process_time(), time.perf_counter()
        losses.append(float(train_step(ids, labels).numpy()))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        activations.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    activation = sorted(activations)[(len(activations) - 1) // 2]  # median (lower)
    cpu_step = sum(cpu) / len(cpu)
    wall_step = sum(wall) / len(wall)
    result = dict(
        recompute=mode, recompute_enabled=recompute.is_enabled(), batch=batch,
        activation_bytes=int(activation), activation_bytes_per_step=[int(a) for a in activations],
        rss_hwm_bytes=_vm_hwm_kib() * 1024, cpu_s_per_step=cpu_step,
        cpu_s_per_step_each=cpu, wall_s_per_step=wall_step, loss=losses[0], params=n_params,
    )
    _progress(f"{tag}: activation memory {activation / MiB:.1f} MiB "
              f"(median of steps: {', '.join(f'{a / MiB:.1f}' for a in activations)}); "
              f"{cpu_step:.2f} CPU s/step ({wall_step:.2f} s wall)")
    with open(out_path, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------
# Parent: spawn the workers, summarise.


def _spawn(cfg, mode, batch, steps):
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["RECOMPUTE"] = mode
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(
        [package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "recompute.benchmark", "--worker", "--out", out,
               "--batch-sizes", str(batch), "--steps", str(steps)]
        for key in SHAPE_KEYS:
            cmd += [f"--{key}", str(cfg[key])]
        _progress(f"RECOMPUTE={mode} batch={batch}: starting a fresh worker process")
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        tail = []
        for line in proc.stderr:
            if line.startswith(PREFIX):
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                tail = (tail + [line])[-40:]
        code = proc.wait()
        if code != 0 or not os.path.exists(out):
            sys.stderr.write("".join(tail))
            raise RuntimeError(
                f"benchmark worker RECOMPUTE={mode} batch={batch} failed with exit "
                f"code {code} (its last stderr lines are above)"
            )
        with open(out) as f:
            return json.load(f)


def _slope(points):
    """Least-squares slope and intercept of [(x, y)]."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def summarize(runs, modes, batch_sizes):
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["recompute"] == mode]
        slope, intercept = _slope([(r["batch"], r["activation_bytes"]) for r in mine])
        rss_slope, _ = _slope([(r["batch"], r["rss_hwm_bytes"]) for r in mine])
        summary[mode] = dict(
            per_sample_bytes=slope, fixed_bytes=intercept, rss_per_sample_bytes=rss_slope,
            cpu_s_per_step={str(r["batch"]): r["cpu_s_per_step"] for r in mine},
        )
    ratios = {}
    if "0" in summary and "1" in summary:
        off, on = summary["0"], summary["1"]
        ratios["memory_per_sample_off_over_on"] = (
            off["per_sample_bytes"] / on["per_sample_bytes"]
            if on["per_sample_bytes"] > 0 else float("inf")
        )
        ratios["rss_per_sample_off_over_on"] = (
            off["rss_per_sample_bytes"] / on["rss_per_sample_bytes"]
            if on["rss_per_sample_bytes"] > 0 else float("inf")
        )
        ratios["cpu_time_on_over_off"] = {
            str(b): on["cpu_s_per_step"][str(b)] / off["cpu_s_per_step"][str(b)]
            for b in batch_sizes
        }
    return summary, ratios


def print_report(cfg, runs, summary, ratios, out=sys.stdout):
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"recompute benchmark: {cfg['layers']} blocks, hidden {cfg['hidden']}, "
      f"{cfg['heads']} heads, FFN {cfg['ffn']}, seq {cfg['seq']}, vocab {cfg['vocab']}, "
      f"dropout {cfg['dropout']}, Adam; {runs[0]['params'] / 1e6:.1f}M parameters")
    p("")
    p(f"{'RECOMPUTE':>9} {'batch':>5} {'activation MiB':>15} {'peak RSS MiB':>13} "
      f"{'CPU s/step':>11} {'loss':>8}")
    for r in runs:
        p(f"{r['recompute']:>9} {r['batch']:>5} {r['activation_bytes'] / MiB:>15.1f} "
          f"{r['rss_hwm_bytes'] / MiB:>13.1f} {r['cpu_s_per_step']:>11.2f} {r['loss']:>8.4f}")
    p("")
    p(f"{'RECOMPUTE':>9} {'MiB/sample':>11} {'fixed MiB':>10} {'RSS MiB/sample':>15}")
    for mode, s in summary.items():
        p(f"{mode:>9} {s['per_sample_bytes'] / MiB:>11.1f} {s['fixed_bytes'] / MiB:>10.1f} "
          f"{s['rss_per_sample_bytes'] / MiB:>15.1f}")
    if ratios:
        p("")
        p(f"activation memory per sample, off/on: x{ratios['memory_per_sample_off_over_on']:.2f}")
        p(f"peak RSS per sample, off/on:          x{ratios['rss_per_sample_off_over_on']:.2f}")
        times = ", ".join(f"batch {b}: x{v:.3f}" for b, v in ratios["cpu_time_on_over_off"].items())
        p(f"CPU time per step, on/off:            {times}")


# --------------------------------------------------------------------------
# Command line.


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _batch_sizes(text):
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 2,6, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 2,6, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"batch sizes must be distinct, got {text!r}")
    return tuple(values)


def _dropout(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _modes(text):
    values = [t for t in text.replace(" ", "").split(",") if t]
    if not values or any(v not in ("0", "1") for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected 0, 1 or 0,1, got {text!r}")
    return tuple(values)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m recompute.benchmark",
        description="Activation memory and CPU time of a BERT-base-shaped Keras 3 "
                    "encoder trained with RECOMPUTE=0 vs RECOMPUTE=1 (each "
                    "configuration in a fresh subprocess).",
    )
    d = FULL
    parser.add_argument("--layers", type=_positive_int, help=f"blocks (default {d['layers']})")
    parser.add_argument("--hidden", type=_positive_int, help=f"hidden size (default {d['hidden']})")
    parser.add_argument("--heads", type=_positive_int, help=f"attention heads (default {d['heads']})")
    parser.add_argument("--ffn", type=_positive_int, help=f"FFN inner size (default {d['ffn']})")
    parser.add_argument("--seq", type=_positive_int, help=f"sequence length (default {d['seq']})")
    parser.add_argument("--vocab", type=_positive_int, help=f"vocabulary size (default {d['vocab']})")
    parser.add_argument("--batch-sizes", type=_batch_sizes,
                        help="comma-separated batch sizes; the per-sample memory is the "
                             "slope between them (default 2,6)")
    parser.add_argument("--steps", type=_positive_int,
                        help=f"timed steps after warm-up (default {d['steps']})")
    parser.add_argument("--dropout", type=_dropout, help=f"dropout rate (default {d['dropout']})")
    parser.add_argument("--modes", type=_modes, default=("0", "1"),
                        help="RECOMPUTE values to run (default 0,1)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shape (2 blocks, hidden 64, seq 64): finishes in seconds; "
                             "explicit options still override it")
    parser.add_argument("--json", metavar="PATH", help="save the results as JSON to PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if args.worker:
        if not args.out or len(args.batch_sizes) != 1:
            parser.error("--worker needs --out and exactly one batch size")
    elif len(args.batch_sizes) < 2:
        parser.error("--batch-sizes needs at least two batch sizes (the per-sample "
                     f"memory is a slope); got {','.join(map(str, args.batch_sizes))}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            parser.error(f"--json: directory {folder!r} does not exist")
    return args


def main(argv=None):
    try:
        return _main(argv)
    except RuntimeError as e:  # a worker failed: its stderr tail is printed already
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(argv=None):
    args = parse_args(argv)
    cfg = {key: getattr(args, key) for key in SHAPE_KEYS}
    if args.worker:
        run_worker(cfg, args.batch_sizes[0], args.steps, args.out)
        return 0

    batch_sizes = sorted(args.batch_sizes)
    runs = []
    start = time.perf_counter()
    # Interleaved (off, on at each batch size) so that a change in the load of
    # the machine during the run does not bias the time ratio.
    for batch in batch_sizes:
        for mode in args.modes:
            runs.append(_spawn(cfg, mode, batch, args.steps))
    runs.sort(key=lambda r: (args.modes.index(r["recompute"]), r["batch"]))
    summary, ratios = summarize(runs, args.modes, batch_sizes)
    _progress(f"done in {time.perf_counter() - start:.0f} s wall")
    print_report(cfg, runs, summary, ratios)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=dict(cfg, batch_sizes=batch_sizes, steps=args.steps),
                           runs=runs, summary=summary, ratios=ratios), f, indent=2)
        _progress(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
