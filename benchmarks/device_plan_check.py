"""Checks XLA's plan of a JAX training step against a real GPU: the micro-batch that fits a budget,
measured, planned on the local device, and planned for a target card.

    python -m benchmarks.device_plan_check          # keras-hub BERT-base, seq 512, fp32,
                                                    # budget 16 GiB, effective batch 256
    python -m benchmarks.device_plan_check --layers 1 --hidden 32 --heads 2 --ffn 64 \\
        --seq 16 --vocab 2000 --effective-batch 16 --budget-gib 0.02    # tiny, any machine

The model is `recompute.planner`'s for `--preset bert-base` (keras-hub's `BertBackbone`,
random weights, the pooled first token into a 2-way `Dense`, Adam, sparse cross-entropy),
its optimizer with gradient accumulation (`accum.AccumOptimizer(k=2)` where TensorFlow
is installed, as the planner measures it; otherwise Keras's own `gradient_accumulation_steps=2`,
one buffer per weight too). Its step is Keras's JAX `train_step` jitted with the state donated
(what `fit` runs), from `recompute._xla_plan`.

For each policy (`--policies`; "attention" and "full" need `recompute`, which imports
TensorFlow: without it only "none" is checked), three answers to "the largest divisor of
the effective batch whose step fits the budget":

- measured: a fresh process per policy compiles the step for the local device and runs it
  (twice) at micro-batches 2 and 4, then, from the line through their measured peaks, at the
  predicted divisor and upward until one does not fit. The peak is the allocator's
  (`jax.devices()[0].memory_stats()["peak_bytes_in_use"]`): JAX cannot reset it, so a
  process measures increasing micro-batches only, and a prediction that does not fit is
  stepped down in another fresh process per divisor. A step that runs out of memory does
  not fit.
- local plan: XLA's plan of the same compilations (`memory_analysis()`: arguments + outputs
  - aliases + temp), read before each run.
- target plan (`--target`, default h100): the same search compiled for the card through
  JAX's CUDA plugin, nothing run (`recompute.plan(..., target=...)`'s reading), in a fresh
  process with JAX_PLATFORMS=cpu,cuda. It may fail where the plugin cannot compile for a
  described card: that is printed, and the rest stands.

Everything runs under a deadline (`--deadline`, default 170 s): a process past it is killed
and what it measured so far is printed. Needs no TensorFlow; JAX with a GPU for "measured"
(on a CPU the measured column is the process's peak RSS, which is not reset either).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

try:  # run as `python -m benchmarks.device_plan_check`
    from . import harness
except ImportError:  # pragma: no cover - run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import harness

TOOL = "benchmarks.device_plan_check"
_progress = harness.Progress(TOOL)
GiB, MiB = harness.GiB, harness.MiB
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522, dropout=0.1,
                effective_batch=256, budget_gib=16.0, batches=(2, 4), target="h100",
                deadline=170.0, learning_rate=2e-5)


def _xla_plan():
    """`recompute._xla_plan`, loaded from its file: the package itself imports TensorFlow,
    which the machine this runs on need not have; the module needs only JAX."""
    name = "_recompute_xla_plan"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(CHECKOUT, "recompute", "_xla_plan.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def predict(points, effective, budget):
    """The largest divisor with the line through `points` [(batch, bytes)] within `budget`
    (the first divisor when none does), as `recompute.planner.predict`."""
    (b1, p1), (b2, p2) = points[:2]
    slope = max((p2 - p1) / (b2 - b1), 0.0)
    intercept = p1 - slope * b1
    fitting = [d for d in divisors(effective) if intercept + slope * d <= budget]
    return (fitting[-1] if fitting else divisors(effective)[0]), intercept, slope


# --------------------------------------------------------------------------
# Worker: one policy, one process.


def _peak_bytes():
    """The local device allocator's peak so far, or the process's peak RSS on a CPU."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "allocator peak_bytes_in_use"
    return harness.peak_rss_kib() * 1024, "peak RSS (VmHWM, CPU)"


def _is_oom(error):
    return harness.is_oom(error) or "RESOURCE_EXHAUSTED" in str(error)


def build(cfg, policy):
    """The model `python -m recompute.planner --preset bert-base` builds for `policy`, and how
    its optimizer accumulates."""
    import keras
    import keras_hub

    if policy != "none":
        import recompute.keras_hub  # imports TensorFlow

        recompute.keras_hub.patch(policy=policy)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=cfg["vocab"], num_layers=cfg["layers"], num_heads=cfg["heads"],
        hidden_dim=cfg["hidden"], intermediate_dim=cfg["ffn"],
        max_sequence_length=max(cfg["seq"], 512), dropout=cfg["dropout"])
    inputs = {name: keras.Input((cfg["seq"],), dtype="int32", name=name)
              for name in ("token_ids", "segment_ids", "padding_mask")}
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(
        backbone(inputs)["pooled_output"]))
    optimizer = None
    if cfg.get("accumulation", "auto") != "keras":
        try:
            from accum import AccumOptimizer  # imports TensorFlow

            optimizer = AccumOptimizer(keras.optimizers.Adam(cfg["learning_rate"]),
                                       steps_per_update=2)
            accumulation = "accum.AccumOptimizer(k=2)"
        except ImportError:
            if cfg.get("accumulation") == "accum":
                raise
    if optimizer is None:
        optimizer = keras.optimizers.Adam(cfg["learning_rate"], gradient_accumulation_steps=2)
        accumulation = "Keras's gradient_accumulation_steps=2"
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, accumulation


def batch_of(cfg, n):
    """`recompute.planner`'s sample (4 rows of random ids from 1000 up, [CLS] first),
    its rows repeated to `n`."""
    import numpy as np

    rng = np.random.RandomState(0)
    ids = rng.randint(min(1000, cfg["vocab"] // 2), cfg["vocab"], size=(4, cfg["seq"]))
    ids = ids.astype("int32")
    ids[:, 0] = 101 if cfg["vocab"] > 101 else 1
    labels = rng.randint(0, 2, size=(4,)).astype("int32")
    rows = np.arange(n) % 4
    ids = ids[rows]
    return ({"token_ids": ids, "segment_ids": np.zeros_like(ids),
             "padding_mask": (ids != 0).astype("int32")}, labels[rows])


def run_worker(cfg, policy, mode, sizes, search, out):
    """Measures (`mode` "measure": compiled for the local device, read, run) or plans
    (`mode` a target's name: compiled for it) the step at `sizes`, in order, then, with
    `search`, from the line through the first two: the predicted divisor and onward. Each
    point is appended to `out` as a JSON line when known."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # fp32: no TF32
    xla = _xla_plan()
    if mode == "measure":
        sharding = None
    else:
        sharding = xla.target_sharding(mode, TOOL)
    _progress(f"{policy}: building the model ({jax.devices()[0].platform} device)")
    model, accumulation = build(cfg, policy)
    point = _point_function(cfg, policy, mode, out, xla, sharding, model, accumulation)
    records = [point(b) for b in sizes]
    if search:
        _search(point, records, cfg, mode)


def _point_function(cfg, policy, mode, out, xla, sharding, model, accumulation):
    """`point(batch)`: the record of `model`'s step at micro-batch `batch` (planned, and with
    `mode` "measure" run and measured), appended to `out`."""
    budget = cfg["budget_gib"] * GiB
    scope = None
    if policy != "none":
        import recompute

        scope = recompute.recompute_scope

    def point(batch):
        x, y = batch_of(cfg, batch)
        t0 = time.perf_counter()
        try:
            if scope is None:
                compiled, planned = xla.train_step_plan(model, x, y, sharding)
            else:
                with scope(True):
                    compiled, planned = xla.train_step_plan(model, x, y, sharding)
        except Exception as e:
            if not _is_oom(e):
                raise
            planned = None
        record = dict(batch=batch, planned=planned and planned["peak"], accumulation=accumulation,
                      compile_seconds=time.perf_counter() - t0)
        if mode == "measure" and planned is not None:
            _run_and_measure(xla, model, compiled, x, y, record)
        value = record.get("measured") if mode == "measure" else record["planned"]
        record["fits"] = value is not None and value <= budget and "oom" not in record
        _progress(f"{policy}, micro-batch {batch} ({mode}): planned "
                  f"{_gib(record['planned'])}, measured {_gib(record.get('measured'))}"
                  f"{' (out of memory)' if 'oom' in record else ''}: "
                  f"{'fits' if record['fits'] else 'does not fit'} "
                  f"({record['compile_seconds']:.0f} s to compile)")
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    return point


def _run_and_measure(xla, model, compiled, x, y, record):
    """Runs the compiled step twice, the second timed and its peak measured, into `record`
    (an `oom` there if it runs out of memory)."""
    try:
        xla.run_step(model, compiled, x, y)
        t0 = time.perf_counter()
        xla.run_step(model, compiled, x, y)
        record["seconds"] = time.perf_counter() - t0
        record["measured"], record["meter"] = _peak_bytes()
    except Exception as e:
        if not _is_oom(e):
            raise
        record["oom"] = f"{type(e).__name__}: {str(e)[:200]}"


def _search(point, records, cfg, mode):
    """From the line through the first two `records`: `point` at the predicted divisor of the
    effective batch, then up while it fits (a plan steps down while it does not)."""
    key = "measured" if mode == "measure" else "planned"
    if any(r.get(key) is None for r in records[:2]):
        return
    divs = divisors(cfg["effective_batch"])
    budget = cfg["budget_gib"] * GiB
    b, _, _ = predict([(r["batch"], r[key]) for r in records[:2]], cfg["effective_batch"], budget)
    i = divs.index(b)
    done = {r["batch"]: r for r in records}
    if mode == "measure":  # increasing only: one process cannot measure a smaller batch after
        i = max(i, max(j for j, d in enumerate(divs) if d <= max(done)))
    while True:
        r = done.get(divs[i]) or point(divs[i])
        done[divs[i]] = r
        if r["fits"]:
            if i + 1 == len(divs):
                return
            i += 1
        elif mode != "measure" and i > 0 and divs[i - 1] not in done:
            i -= 1  # a plan can step down: nothing ran
        else:
            return


# --------------------------------------------------------------------------
# Parent.


def _gib(value):
    return "-" if value is None else f"{value / GiB:.3f} GiB"


def _run(cfg, policy, mode, sizes, search, deadline, env_extra=None):
    """Starts a worker; returns its points (those it wrote before a failure or the deadline)
    and an error text or None."""
    remaining = deadline - time.monotonic()
    if remaining < 5:
        return [], "not started: the deadline has passed"
    fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="device_plan_check_")
    os.close(fd)
    env = dict(os.environ, KERAS_BACKEND="jax", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([CHECKOUT] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    argv = [sys.executable, "-m", TOOL, "--worker", mode, "--policy", policy,
            "--sizes", ",".join(map(str, sizes)), "--out", out, "--config", json.dumps(cfg)]
    if search:
        argv.append("--search")
    error = None
    try:
        result = subprocess.run(argv, cwd=CHECKOUT, env=env, timeout=remaining,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in result.stderr.splitlines():
            if line.startswith(f"[{TOOL}]"):
                print(line, file=sys.stderr, flush=True)
        if result.returncode != 0:
            tail = [l for l in result.stderr.splitlines() if l.strip()][-3:]
            error = f"worker exited with {result.returncode}: " + " | ".join(tail)[-600:]
    except subprocess.TimeoutExpired:
        error = "stopped at the deadline"
    with open(out) as f:
        points = [json.loads(line) for line in f if line.strip()]
    os.unlink(out)
    return points, error


def answer(points, effective):
    """(micro-batch that fits, the next divisor up refused or None) from the points, or
    (None, None) when no divisor's answer is known to fit."""
    by = {p["batch"]: p for p in points}
    divs = divisors(effective)
    fitting = [d for d in divs if d in by and by[d]["fits"]]
    if not fitting:
        return None, None
    best = fitting[-1]
    up = divs[divs.index(best) + 1] if best != effective else None
    if up is not None and (up not in by or by[up]["fits"]):
        return best, None  # the next divisor up is unknown: a lower bound
    return best, up


def check_policy(cfg, policy, target, deadline):
    effective = cfg["effective_batch"]
    row = dict(policy=policy, errors=[])
    first = sorted(cfg.get("start_sizes") or cfg["batches"])
    if cfg.get("measure", True):
        _progress(f"{policy}: measuring on the local device")
        points, error = _run(cfg, policy, "measure", first, True, deadline)
    else:
        points, error = [], None
    if error:
        row["errors"].append(f"measured: {error}")
    # a prediction that did not fit: step down, a fresh process per divisor (peaks do not reset)
    divs = divisors(effective)
    while points and not error:
        by = {p["batch"]: p for p in points}
        fitting = [d for d in divs if d in by and by[d]["fits"]]
        lowest_refused = min((d for d in divs if d in by and not by[d]["fits"]), default=None)
        if lowest_refused is None or (fitting and divs[divs.index(fitting[-1]) + 1] ==
                                      lowest_refused):
            break
        below = divs[divs.index(lowest_refused) - 1]
        if below in by:
            break
        more, error = _run(cfg, policy, "measure", [below], False, deadline)
        points += more
        if error:
            row["errors"].append(f"measured at {below}: {error}")
    row["measured_points"] = points
    row["measured"], row["measured_refused"] = answer(points, effective)
    local = [dict(p, fits=p["planned"] is not None and p["planned"] <= cfg["budget_gib"] * GiB)
             for p in points if p.get("planned") is not None]
    row["local_plan"], row["local_plan_refused"] = answer(local, effective)
    if target != "none":
        _progress(f"{policy}: planning for {target} (compiled, not run)")
        tpoints, terror = _run(cfg, policy, target, first, True, deadline,
                               env_extra={"JAX_PLATFORMS": "cpu,cuda",
                                          "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"})
        if terror:
            row["errors"].append(f"{target} plan: {terror}")
        row["target_points"] = tpoints
        row["target_plan"], row["target_plan_refused"] = answer(tpoints, effective)
    return row


def agreement(a, b):
    if a is None or b is None:
        return "-"
    return f"{abs(a - b) / max(a, b) * 100:.0f}%"


def report(rows, cfg, target, seconds):
    budget = cfg["budget_gib"]
    lines = [f"{TOOL}: keras-hub BertBackbone {cfg['layers']} layers, hidden {cfg['hidden']}, "
             f"seq {cfg['seq']}, fp32; effective batch {cfg['effective_batch']}, budget "
             f"{budget:g} GiB; {seconds:.0f} s", "",
             "| policy | measured micro-batch | measured peak | next divisor measured | "
             f"local plan micro-batch | {target} plan micro-batch | measured vs {target} plan |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        by = {p["batch"]: p for p in r.get("measured_points", [])}
        m = r.get("measured")
        refused = r.get("measured_refused")
        lines.append(
            f"| {r['policy']} | {m if m is not None else '-'} | "
            f"{_gib(by[m].get('measured')) if m in by else '-'} | "
            f"{'-' if refused is None else f'{refused}: ' + _gib(by[refused].get('measured'))} | "
            f"{r.get('local_plan') or '-'} | {r.get('target_plan') or '-'} | "
            f"{agreement(m, r.get('target_plan'))} |")
    lines.append("")
    for r in rows:
        for kind in ("measured", "target"):
            for p in r.get(f"{kind}_points", []):
                lines.append(
                    f"- {r['policy']}, {'local device' if kind == 'measured' else target}, "
                    f"micro-batch {p['batch']}: planned {_gib(p.get('planned'))}"
                    + (f", measured {_gib(p.get('measured'))} ({p.get('meter')})"
                       if kind == "measured" else "")
                    + (f", {p['seconds'] / p['batch']:.4f} s/sample" if p.get("seconds") else "")
                    + (" (out of memory)" if "oom" in p else "")
                    + f", {'fits' if p['fits'] else 'does not fit'}; {p['accumulation']}")
        for e in r["errors"]:
            lines.append(f"- {r['policy']}: {e}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = harness.parser(TOOL, __doc__.split("\n\n")[1])
    for name in ("layers", "hidden", "heads", "ffn", "seq", "vocab", "effective_batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=harness.positive_int,
                       default=DEFAULTS[name])
    p.add_argument("--budget-gib", type=harness.positive_float, default=DEFAULTS["budget_gib"])
    p.add_argument("--batches", type=harness.int_list, default=DEFAULTS["batches"],
                   help="the two micro-batches of the line (default 2,4)")
    p.add_argument("--start-sizes", type=harness.int_list, default=None,
                   help="the micro-batches measured first, in one process (default: --batches; "
                   "e.g. a plan's micro-batch and the next divisor, to check it in one "
                   "process); the search goes on from the line through the first two")
    p.add_argument("--policies", type=harness.name_list(("none", "attention", "full")),
                   default=None, help="default: none,attention,full where recompute imports "
                   "(TensorFlow installed), else none")
    p.add_argument("--target", default=DEFAULTS["target"],
                   help="h100, a100-40, l4, rtx4090, or none (default h100)")
    p.add_argument("--deadline", type=harness.positive_float, default=DEFAULTS["deadline"],
                   help="seconds for everything (default 170)")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="only the target's plan (nothing runs)")
    p.add_argument("--accumulation", choices=("auto", "accum", "keras"), default="auto",
                   help="the optimizer's accumulation buffers: accum.AccumOptimizer (as "
                   "recompute.plan; needs TensorFlow), Keras's gradient_accumulation_steps, "
                   "or auto (the first where TensorFlow is installed)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--worker", help=argparse_hidden())
    p.add_argument("--policy", help=argparse_hidden())
    p.add_argument("--sizes", type=harness.int_list, help=argparse_hidden())
    p.add_argument("--search", action="store_true", help=argparse_hidden())
    p.add_argument("--out", help=argparse_hidden())
    p.add_argument("--config", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker is None:
        if len(set(args.batches)) != 2:
            p.error(f"--batches needs two different sizes. Received: {args.batches}")
        sizes = args.start_sizes
        if sizes and (len(set(sizes)) < 2 or any(args.effective_batch % b for b in sizes)):
            p.error(f"--start-sizes needs two or more different divisors of --effective-batch "
                    f"({args.effective_batch}). Received: {sizes}")
        if args.hidden % args.heads:
            p.error(f"--hidden must be a multiple of --heads. Received: {args.hidden} and "
                    f"{args.heads}")
        targets = ("h100", "a100-40", "l4", "rtx4090", "none")
        if args.target not in targets:
            p.error(f"--target must be one of {', '.join(targets)}. Received: {args.target!r}")
    return args


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def _recompute_importable():
    probe = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                           timeout=120)
    return probe.returncode == 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(json.loads(args.config), args.policy, args.worker, args.sizes, args.search,
                   args.out)
        return 0
    start = time.monotonic()
    deadline = start + args.deadline
    cfg = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn,
               seq=args.seq, vocab=args.vocab, dropout=DEFAULTS["dropout"],
               effective_batch=args.effective_batch, budget_gib=args.budget_gib,
               batches=sorted(args.batches), learning_rate=DEFAULTS["learning_rate"],
               start_sizes=sorted(args.start_sizes) if args.start_sizes else None,
               measure=args.measure, accumulation=args.accumulation)
    if cfg["effective_batch"] < cfg["batches"][0]:
        _progress(f"error: --effective-batch {cfg['effective_batch']} is below the smallest "
                  f"micro-batch measured ({cfg['batches'][0]})")
        return 2
    policies = args.policies
    if policies is None:
        policies = ("none", "attention", "full") if _recompute_importable() else ("none",)
        if policies == ("none",):
            _progress("TensorFlow is not installed: recompute (its patches) cannot be "
                      "imported, only policy none is checked")
    rows = []
    for policy in policies:
        try:
            rows.append(check_policy(cfg, policy, args.target, deadline))
        except Exception as e:  # report, never hang
            rows.append(dict(policy=policy, errors=[f"{type(e).__name__}: {e}"]))
    print(report(rows, cfg, args.target, time.monotonic() - start))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=cfg, target=args.target, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
