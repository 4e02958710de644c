"""XLA:GPU's memory plan of a JAX training step, on any machine: no GPU needed.

    python -m benchmarks.gpu_plan                        # keras-hub BERT-base, seq 512, H100
    python -m benchmarks.gpu_plan --model standard --layers 2,8 --hidden 128 --heads 2 \\
        --ffn 256 --seq 256                              # small widths, two depths
    python -m benchmarks.gpu_plan --docs docs/attention.md
    python -m benchmarks.gpu_plan --policies full --cores auto --offload  # inputs on the host

XLA compiles a jitted step for a GPU it is told about (`TARGETS`: a
`GpuTargetConfigProto` of the card's facts, in text form) through the CUDA
plugin of JAX (`jax-cuda12-pjrt` and `jax-cuda12-plugin` of jax's version, in
the `[test]` extra; no NVIDIA library, no driver). The compilation runs
XLA:GPU's own passes -- fusion, the horizontal loop fusion XLA:CPU lacks,
rematerialization, buffer assignment -- and `memory_analysis()` gives its
plan: the temporary buffer (activations kept for the backward pass, and the
working set of both passes), the arguments and the outputs. It predicts
memory, not time. Where both exist it matched an H100's allocator: the
keras-hub BERT-base step under `"full"` with Keras's attention core planned
78.0 MiB per sample, the H100 measured 82.5 (docs/attention.md).

What is compiled, per row and batch: keras-hub's `BertBackbone` (`--model
hub`, default) or the standard Keras 3 block of `benchmarks.encoder`
(`--model standard`), the pooled first token through dropout into a 2-way
`Dense`, sparse cross-entropy, and the gradient of that loss over every
trainable weight (`jax.value_and_grad` of `stateless_call`, training=True:
dropout on, seed state an argument); float32 (`--precision bf16`: Keras's
`mixed_bfloat16`). Rows: RECOMPUTE=0, and each policy of `--policies` with
the attention core the library chooses (`recompute.attention_core`, "auto"),
and, as a diagnostic, with each core forced (`blocked`, `keras`). The MiB per
sample is the slope of the temp buffer over `--batches` (default 8 and 32, the batches
at which `benchmarks.peer` measured the H100: at small batches the step's fixed buffers --
the embedding table's gradient, 94 MiB at BERT-base -- can set the peak, and the slope
between 2 and 4 then says less than what a sample costs at a batch that fills a GPU; under
"full" at BERT-base it gave 19.5 MiB per sample where 8 and 32 give 56.9, docs/attention.md).

Under `"full"` each recomputed block runs its batch in cuts of `--batch-cut` samples
(`recompute.batch_cut`; by default about 4,096 rows, 8 samples at seq 512; 0: whole
batches), where the batch is larger than one cut: at the default batches, 8 runs whole and
32 in four cuts, so the slope is what a sample adds beyond one cut's working set.

`--offload` adds a row "full" with `offload=True` (each block's inputs kept in pinned host
memory: `recompute_grad(offload=True)`, `recompute.keras_hub.patch(offload=True)`) and
two columns, the host temporaries per sample and at the largest batch (the device's
columns count the device only).

Columns: temp MiB per sample; temp, argument and output MiB at the largest
batch; the compiled module's `while` loops and its exponentials over the key
axis (a softmax pass over whole or blocked rows: the forward pass, the
recomputation and the backward pass each count theirs) per layer.

Runs in one process: the CUDA platform must be named before JAX starts
(`JAX_PLATFORMS=cpu,cuda`, `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`), so the tool
sets both and refuses to run if JAX was imported without them.
"""

import os
import re
import sys

from recompute import _xla_plan

from . import harness
from .harness import MiB

TOOL = "benchmarks.gpu_plan"
_progress = harness.Progress(TOOL)

# The cards and the compilation are the library's (`recompute._xla_plan`, which
# `recompute.plan(..., target=...)` uses too).
TARGETS = _xla_plan.TARGETS
_ENV = _xla_plan.ENV

DEFAULTS = dict(model="hub", layers=(12,), hidden=768, heads=12, ffn=3072, seq=512, vocab=30522,
                dropout=0.1, batches=(8, 32), policies=("0", "attention", "full"),
                cores=("auto", "blocked", "keras"), target="h100", precision="fp32")


# --------------------------------------------------------------------------
# The target: a one-device mesh of a GPU this machine need not have.


def prepare_environment():
    """Names the CUDA platform for JAX (before JAX starts) and selects Keras's JAX backend;
    a RuntimeError if JAX has started without the platform."""
    _xla_plan.prepare_environment(TOOL)
    os.environ["KERAS_BACKEND"] = "jax"


def target_sharding(target):
    """The sharding of one device of `target` (a name of `TARGETS`): what the step's
    abstract arguments carry so that `jax.jit` lowers and compiles for that GPU."""
    return _xla_plan.target_sharding(target, TOOL)


def compile_plan(fn, args, sharding):
    """`fn(*args)` (arrays or shapes) compiled by XLA:GPU for `sharding`'s device: a dict of
    its planned bytes (temp, arguments, outputs, aliases, peak) and the optimized module's
    text."""
    return _xla_plan.compile_plan(fn, args, sharding)


def count_module(hlo, keys):
    """(while loops, exponentials whose last axis has `keys` entries) in a compiled module."""
    loops = len(re.findall(r"\)\s+while\(%", hlo))  # `%w = (tuple shape) while(%init), ...`
    exps = len(re.findall(r"=\s*[a-z0-9]+\[[0-9,]*,%d\]\S*\s+exponential\(" % keys, hlo))
    return loops, exps


# --------------------------------------------------------------------------
# The step.


OFFLOAD = "full+offload"  # the row of `--offload`: "full" with `offload=True`


def build_model(cfg, policy, core):
    """The classifier for a row (`benchmarks.peer`'s): keras-hub's BertBackbone, patched for
    `policy` (unpatched for "0"; `OFFLOAD`: "full", inputs offloaded), or the standard Keras 3
    blocks; `core` the attention core the library uses (`recompute.attention_core`)."""
    import recompute

    from .peer import keras_model

    recompute.attention_core(core)
    if cfg["model"] == "hub" and policy == "0":
        import recompute.keras_hub

        recompute.keras_hub.unpatch()  # one process builds every row
    if policy == OFFLOAD:
        return keras_model(cfg, cfg["model"], "full", offload=True)
    return keras_model(cfg, cfg["model"], policy)


def step_plan(model, cfg, policy, batch, sharding):
    """XLA:GPU's plan of one training step's loss and gradients of a row's `model` at `batch`."""
    import keras

    from recompute import recompute_scope

    from .peer import keras_inputs, make_batch

    ids, mask, labels = make_batch(batch, cfg["seq"], cfg["vocab"], seed=0)
    x = keras_inputs(cfg["model"], ids, mask)
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(trainable, non_trainable, x, y):
        logits, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return cross_entropy(y, logits)

    import jax

    args = ([v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables], x, labels)
    with recompute_scope(policy != "0"):
        plan = compile_plan(jax.value_and_grad(loss), args, sharding)
    plan["loops"], plan["exps"] = count_module(plan.pop("hlo"), cfg["seq"])
    return plan


# --------------------------------------------------------------------------
# The table.


def rows_of(policies, cores):
    """(policy, core) of each row: RECOMPUTE=0 once (its core is Keras's: nothing is
    recomputed), each policy with each core."""
    return [(p, "keras" if p == "0" else c) for p in policies for c in (cores if p != "0" else
                                                                        cores[:1])]


def measure(cfg, policies, cores, target):
    """The rows' plans at each depth of `cfg["layers"]`: a list of dicts."""
    if cfg["precision"] == "bf16":
        import keras

        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest" if cfg["precision"] == "fp32"
                      else None)
    sharding = target_sharding(target)
    results = []
    for layers in cfg["layers"]:
        for policy, core in rows_of(policies, cores):
            row_cfg = dict(cfg, layers=layers)
            model = build_model(row_cfg, policy, core)  # its core stays set while compiling
            plans = []
            for batch in cfg["batches"]:
                _progress(f"{layers} layers, {row_name(policy, core)}, batch {batch}: compiling "
                          f"for {target}")
                plans.append(step_plan(model, row_cfg, policy, batch, sharding))
            per_sample, _ = harness.slope([(b, p["temp"]) for b, p in zip(cfg["batches"], plans)])
            host, _ = harness.slope([(b, p["host_temp"]) for b, p in zip(cfg["batches"], plans)])
            results.append(dict(layers=layers, policy=policy, core=core,
                                per_sample_mib=per_sample / MiB, host_per_sample_mib=host / MiB,
                                **plans[-1],
                                loops_per_layer=plans[-1]["loops"] / layers,
                                exps_per_layer=plans[-1]["exps"] / layers))
    return results


def row_name(policy, core):
    if policy == OFFLOAD:
        return f'"full", offload, core {core}'
    return "RECOMPUTE=0" if policy == "0" else f'"{policy}", core {core}'


def _cut_words(samples, seq):
    """How `"full"`'s recomputed blocks cut the batch, in words: `samples` as `--batch-cut`
    gave it, the cut the library's rule makes of it at `seq` (`samples_per_cut`)."""
    from recompute.engine._batch_cut import samples_per_cut

    cut = samples_per_cut(seq)  # the setting `main` made: `recompute.batch_cut(samples)`
    if cut is None:
        return '"full" on whole batches (batch cut 0)'
    return f'"full" in cuts of {cut} samples' + (" (the default)" if samples is None else "")


def format_table(results, cfg, target):
    batch = cfg["batches"][-1]
    offload = any(r["policy"] == OFFLOAD for r in results)
    lines = [f"XLA:GPU plan for {TARGETS[target]['name']} (compiled here, no GPU): "
             f"{'keras-hub BertBackbone' if cfg['model'] == 'hub' else 'standard Keras 3 blocks'}, "
             f"hidden {cfg['hidden']}, {cfg['heads']} heads, FFN {cfg['ffn']}, seq {cfg['seq']}, "
             f"dropout {cfg['dropout']}, {cfg['precision']}; "
             f"{_cut_words(cfg.get('batch_cut'), cfg['seq'])}; MiB per sample = slope of the temp "
             f"buffer over batches {', '.join(map(str, cfg['batches']))}",
             "",
             f"| layers | row | temp MiB / sample | temp MiB @ {batch} | arguments MiB | "
             "outputs MiB | loops / layer | softmax exps / layer |"
             + (" host temp MiB / sample | host temp MiB @ %d |" % batch if offload else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if offload else "")]
    for r in results:
        lines.append(f"| {r['layers']} | {row_name(r['policy'], r['core'])} | "
                     f"{r['per_sample_mib']:.1f} | {r['temp'] / MiB:.1f} | "
                     f"{r['arguments'] / MiB:.1f} | {r['outputs'] / MiB:.1f} | "
                     f"{r['loops_per_layer']:g} | {r['exps_per_layer']:g} |"
                     + (f" {r['host_per_sample_mib']:.1f} | {r['host_temp'] / MiB:.1f} |"
                        if offload else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
    p = harness.parser(TOOL, __doc__.split("\n\n")[1])
    p.add_argument("--model", choices=("hub", "standard"), default=DEFAULTS["model"])
    p.add_argument("--layers", type=harness.int_list, default=DEFAULTS["layers"],
                   help="depths, comma-separated (default 12)")
    for name in ("hidden", "heads", "ffn", "seq", "vocab"):
        p.add_argument(f"--{name}", type=harness.positive_int, default=DEFAULTS[name])
    p.add_argument("--dropout", type=harness.fraction, default=DEFAULTS["dropout"])
    p.add_argument("--batches", type=harness.int_list, default=DEFAULTS["batches"],
                   help="two or more batch sizes (default 8,32)")
    p.add_argument("--policies", type=harness.name_list(("0", "attention", "full")),
                   default=DEFAULTS["policies"])
    p.add_argument("--cores", type=harness.name_list(("auto", "blocked", "keras")),
                   default=DEFAULTS["cores"], help="attention cores per policy row "
                   "(default auto,blocked,keras; auto is the library's choice)")
    p.add_argument("--batch-cut", type=harness.non_negative_int, default=None, metavar="SAMPLES",
                   help='samples per cut of a recomputed block under "full" '
                   "(`recompute.batch_cut`; default: the library's rule, about 4096 rows; "
                   "0: whole batches)")
    p.add_argument("--offload", action="store_true", help='also a row "full" with '
                   "offload=True (inputs in host memory), and host temporaries apart")
    p.add_argument("--target", choices=sorted(TARGETS), default=DEFAULTS["target"])
    p.add_argument("--precision", choices=("fp32", "bf16"), default=DEFAULTS["precision"])
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    harness.add_docs_argument(p, TOOL)
    args = p.parse_args(argv)
    if len(set(args.batches)) < 2:
        p.error(f"--batches needs two or more different sizes. Received: {args.batches}")
    if args.hidden % args.heads:
        p.error(f"--hidden must be a multiple of --heads. Received: {args.hidden} and {args.heads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    prepare_environment()
    sys.path.insert(0, harness.CHECKOUT)
    cfg = {k: getattr(args, k) for k in ("model", "layers", "hidden", "heads", "ffn", "seq",
                                          "vocab", "dropout", "batches", "precision")}
    policies = list(args.policies)
    if args.offload:
        policies.insert(policies.index("full") + 1 if "full" in policies else len(policies), OFFLOAD)
    import recompute

    recompute.batch_cut(args.batch_cut)
    cfg["batch_cut"] = args.batch_cut
    results = measure(cfg, policies, args.cores, args.target)
    with harness.report_to_docs(args.docs, TOOL, argv):
        print(format_table(results, cfg, args.target))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"config": cfg, "target": args.target, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    # Keras started (on TensorFlow, by the package's imports) before the CUDA platform could
    # be named: run again with both set; JAX is the tool's backend whatever the shell says
    _xla_plan.rerun_with_environment(TOOL, sys.argv[1:], force_backend=True)
    sys.exit(main())
