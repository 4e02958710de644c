"""What batch fits? `recompute.plan` measured on a bert4keras BERT: the policy, the micro-batch
and the accumulation steps it chooses within a memory budget, and what that choice cost.

    python -m benchmarks.batchfit --quick
    python -m benchmarks.batchfit --models base,large --seq-len 512 --budget-gib 8 \\
        --effective-batch 256
    python -m benchmarks.batchfit --models minilm --seq-len 256 --budget-gib 4 \\
        --effective-batch 64 --json out.json --plot out.png

Run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (bert4keras on tf_keras). This tool measures the
library's planner; it does not search itself. For each model shape (`base`: 12 layers, hidden
768, 12 heads, FFN 3072; `large`: 24, 1024, 16, 4096; `minilm`: the real MiniLM, 6, 384, 12,
1536, with its converted weights from `recompute.bert4keras.converter.minilm()`; `tiny`: 2,
64, 8, 256 for smoke tests; vocabulary 30522 except `tiny`) it calls

    recompute.plan(build_model, x, y, effective_batch, budget_gib,
                   policies=(None,) + policies, batches=batches)

in this process, where `build_model(policy)` calls `recompute.bert4keras.patch(policy=...)`
(None: the "block" model with recomputation off), builds the model with bert4keras's
`build_transformer_model` (dropout 0.1 as in BERT) plus a classification head (the CLS
token's vector -> `Dense(2)`) and compiles it with tf_keras Adam and a sparse cross-entropy;
(x, y) are 4 rows of random token ids with padded tails and random labels. How the plan
measures (a line through two small micro-batches, a prediction, a check by real steps) is
docs/plan.md's.

Output: the planner's progress lines on stderr, then per model the plan's table on stdout
(one row per policy: the line, the micro-batch predicted, the one measured to fit, the next
divisor measured not to, the seconds per sample measured -- or "~" estimated from the line's
small steps for a policy not checked) and the planner's cost: wall seconds and this process's
CPU seconds. `--plot PATH` (default batchfit.png) draws each policy's measured peaks against
the micro-batch, one panel per model, the budget as a horizontal line; `--json PATH` saves
every plan (`recompute.Plan.as_dict()`); `--docs PAGE` writes the report into a docs/ page.

`--quick` (the first thing to run on a fresh machine, a few minutes on 2 CPU cores): the real
MiniLM only, sequence length 256, a 2 GiB budget, effective batch 32; then the fine-tuning
example, `examples/bert_finetune.py --recompute --accum-steps 4` (8 updates of 4
micro-batches of 4, seq 32), on the sentence-polarity data at `../shared/data/rt-polarity`
beside the checkout if it is there, else on 40 sentences embedded here; its output follows
the table and its results go into `--json`.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from . import harness
from .harness import GiB

TOOL = "benchmarks.batchfit"
_progress = harness.Progress(TOOL)

# Transformer shapes. `minilm` is the real model: its weights (and exact
# config) come from `recompute.bert4keras.converter.minilm()` when that is available.
SHAPES = {
    "base": dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522),
    "large": dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522),
    "minilm": dict(layers=6, hidden=384, heads=12, ffn=1536, vocab=30522),
    "tiny": dict(layers=2, hidden=64, heads=8, ffn=256, vocab=1000),
}
DROPOUT = 0.1
LEARNING_RATE = 2e-5

FULL = dict(models=("base", "large"), seq_len=512, budget_gib=8.0, effective_batch=256)
QUICK = dict(models=("minilm",), seq_len=256, budget_gib=2.0, effective_batch=32)

ENV = {"TF_KERAS": "1", "TF_USE_LEGACY_KERAS": "1"}
POLICIES = ("layer", "block", "attention", "block_keep_ffn")  # of recompute.bert4keras.patch


def policy_of(mode):
    """The `patch()` policy of a mode: "0" -> None (RECOMPUTE=0), "1" -> "block"."""
    return None if mode == "0" else ("block" if mode == "1" else mode)


# --------------------------------------------------------------------------
# The model: bert4keras BERT + CLS -> Dense(2).


def _bert_config(shape, seq_len, base_config=None):
    """A bert_config.json dict for `shape` (or `base_config`, the real model's) with BERT's dropout."""
    config = dict(base_config or {})
    if not base_config:
        config.update(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            intermediate_size=shape["ffn"], hidden_act="gelu",
            max_position_embeddings=max(512, seq_len), type_vocab_size=2,
            initializer_range=0.02,
        )
    if config.get("max_position_embeddings", 512) < seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's "
                         f"max_position_embeddings {config['max_position_embeddings']}")
    config.update(hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
    return config


def build_classifier(config_path, checkpoint_path=None):
    """bert4keras BERT from `config_path` (weights from `checkpoint_path` if given) + CLS -> Dense(2).

    Call `recompute.bert4keras.patch()` before the first import of bert4keras.
    """
    from bert4keras.backend import keras
    from bert4keras.models import build_transformer_model

    bert = build_transformer_model(config_path, checkpoint_path)
    cls = keras.layers.Lambda(lambda x: x[:, 0], name="CLS")(bert.output)
    logits = keras.layers.Dense(2, name="classifier")(cls)
    return keras.Model(bert.inputs, logits)


def make_optimizer(accum_steps, learning_rate=LEARNING_RATE):
    """tf_keras Adam, wrapped in `AccumOptimizer(..., steps_per_update=accum_steps)` if > 1."""
    import tf_keras

    optimizer = tf_keras.optimizers.Adam(learning_rate)
    if accum_steps > 1:
        from accum import AccumOptimizer

        optimizer = AccumOptimizer(optimizer, steps_per_update=accum_steps)
    return optimizer


def _random_batches(n, batch, seq_len, vocab, seed):
    """`n` batches of random token ids ([CLS] first, padded tails) and random labels."""
    import numpy as np

    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        ids = rng.randint(1000 if vocab > 2000 else 1, vocab, size=(batch, seq_len))
        ids[:, 0] = 101 if vocab > 101 else 1
        # Lengths between half and all of seq_len; the longest row is full.
        lengths = rng.randint(seq_len // 2, seq_len + 1, size=batch)
        lengths[0] = seq_len
        for row, length in enumerate(lengths):
            ids[row, length:] = 0
        out.append(([ids, np.zeros_like(ids)], rng.randint(0, 2, size=batch)))
    return out


# --------------------------------------------------------------------------
# The model and its plan.


def check_env():
    """RuntimeError unless bert4keras runs on tf_keras here (`ENV` set)."""
    missing = [f"{k}={v}" for k, v in ENV.items() if os.environ.get(k) != v]
    if missing:
        raise RuntimeError(f"bert4keras needs {' '.join(missing)} in the environment: "
                           f"{' '.join(missing)} python -m {TOOL} ...")


def _prepare_config(spec, tmp):
    base_config = None
    if spec.get("config_path"):
        with open(spec["config_path"]) as f:
            base_config = json.load(f)
    config = _bert_config(spec["shape"], spec["seq_len"], base_config)
    path = os.path.join(tmp, "bert_config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def compiled_classifier(spec):
    """The candidate's model, seeded and compiled: `build_classifier` for `spec`
    (shape, seq_len, accum_steps, optionally config_path/checkpoint_path)
    with `make_optimizer` and a sparse cross-entropy on the logits.

    Call `recompute.bert4keras.patch()` first (as `build_classifier`)."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = _prepare_config(spec, tmp)
        model = build_classifier(config_path, spec.get("checkpoint_path"))
    model.compile(optimizer=make_optimizer(spec["accum_steps"]),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def model_builder(shape, seq_len, paths=None):
    """`build_model(policy)` for `recompute.plan`: `patch(policy=policy or "block")`, then
    `compiled_classifier` (plain Adam: the planner wraps it in `AccumOptimizer`)."""
    import recompute.bert4keras

    def build_model(policy):
        recompute.bert4keras.patch(policy=policy or "block")
        return compiled_classifier(dict(shape=shape, seq_len=seq_len, accum_steps=1,
                                        **(paths or {})))

    return build_model


def plan_model(model, opts, paths=None):
    """`recompute.plan` of one model shape with `opts` (seq_len, effective_batch,
    budget_gib, policies, batches, memory); returns dict(model, plan, wall_s, cpu_s)."""
    import numpy as np

    import recompute

    shape = SHAPES[model]
    (ids, segments), labels = _random_batches(1, 4, opts["seq_len"], shape["vocab"], seed=0)[0]
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    plan = recompute.plan(model_builder(shape, opts["seq_len"], paths), [ids, segments],
                          np.asarray(labels), opts["effective_batch"], opts["budget_gib"],
                          policies=(None,) + tuple(opts["policies"]), batches=opts["batches"],
                          memory=opts.get("memory", "auto"))
    return dict(model=model, plan=plan, wall_s=time.perf_counter() - start_wall,
                cpu_s=time.process_time() - start_cpu)


def print_report(results, opts, out=None):
    """Per model: the plan's table and what the plan cost (wall and CPU seconds)."""
    out = sys.stdout if out is None else out  # the current one: report_to_docs redirects it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"what batch fits? recompute.plan on bert4keras BERT + CLS->Dense(2), tf_keras Adam, "
      f"dropout {DROPOUT}, seq {opts['seq_len']}, effective batch {opts['effective_batch']}, "
      f"budget {opts['budget_gib']:g} GiB")
    for r in results:
        p("")
        p(f"{r['model']}:")
        p(r["plan"].table())
        p(f"{r['model']}: planned in {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} CPU s "
          f"(this process, all threads)")


def plot(results, opts, path):
    """PNG: each policy's measured peaks against the micro-batch (filled: within the
    budget, hollow: over it), one panel per model, the budget as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    budget = opts["budget_gib"]
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple")
    for ax, r in zip(axes[0], results):
        for color, cand in zip(colors, r["plan"].candidates):
            points = sorted((b, p / GiB) for b, (p, _) in cand.points.items()
                            if p != float("inf"))
            if not points:
                continue
            label = (f"{cand.policy or 'no recomputation'}: "
                     + (f"micro-batch {cand.micro_batch}" if cand.fits else
                        (cand.error or "none fits").split(":")[0]))
            ax.plot(*zip(*points), color=color, lw=1, alpha=0.6)
            ok = [(b, p) for b, p in points if p <= budget]
            bad = [(b, p) for b, p in points if p > budget]
            if ok:
                ax.scatter(*zip(*ok), color=color, label=label, zorder=3)
            if bad:
                ax.scatter(*zip(*bad), facecolors="none", edgecolors=color, zorder=3,
                           label=None if ok else label)
        ax.axhline(budget, color="k", ls="--", lw=1, label=f"budget {budget:g} GiB")
        ax.set_title(f"{r['model']}, seq {opts['seq_len']}: policy "
                     f"{r['plan'].policy or 'none'}, {r['plan'].micro_batch} x "
                     f"{r['plan'].steps_per_update}", fontsize=9)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("peak (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("What batch fits? recompute.plan's measured steps (hollow: over the budget)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# The real MiniLM and the --quick fine-tuning run.


def minilm_paths():
    """{"config_path", "checkpoint_path", "vocab_path"} of the converted MiniLM, or None.

    Uses `recompute.bert4keras.converter.minilm()` (converted once, then cached) when
    that module exists; None otherwise (the MiniLM shape with random weights).
    """
    try:
        from recompute.bert4keras import converter as hf_convert
    except ImportError:
        _progress("recompute.bert4keras.converter is not available: MiniLM gets random weights "
                  "(same shape)")
        return None
    try:
        converted = hf_convert.minilm()
    except (ImportError, OSError) as e:  # the MiniLM package is not installed
        _progress(f"no MiniLM weights ({e}): MiniLM gets random weights (same shape)")
        return None
    return dict(config_path=str(converted.config_path),
                checkpoint_path=str(converted.checkpoint_path),
                vocab_path=str(converted.vocab_path))


# 40 short sentences written for the --quick fine-tuning demo (not from any data
# set; used when the shared sentence-polarity data is absent): 1 = positive.
SENTENCES = [
    ("a warm, funny and beautifully acted film", 1),
    ("the best movie i have seen this year", 1),
    ("a delightful story with a big heart", 1),
    ("smart, moving and wonderfully made", 1),
    ("the cast is superb and the script sparkles", 1),
    ("i loved every minute of it", 1),
    ("a charming and clever comedy", 1),
    ("gorgeous images and a touching score", 1),
    ("an inspiring, joyful experience", 1),
    ("the director delivers a triumph", 1),
    ("tense, thrilling and never dull", 1),
    ("a genuinely sweet and uplifting tale", 1),
    ("brilliant performances all around", 1),
    ("funny, fresh and full of surprises", 1),
    ("a masterpiece of quiet emotion", 1),
    ("i would happily watch it again", 1),
    ("a lovely, honest little film", 1),
    ("the ending is perfect and earned", 1),
    ("great fun for the whole family", 1),
    ("a rich and rewarding drama", 1),
    ("a dull, lifeless and boring film", 0),
    ("the worst movie i have seen this year", 0),
    ("a tedious story with no heart", 0),
    ("stupid, clumsy and badly made", 0),
    ("the cast is wasted and the script is awful", 0),
    ("i hated every minute of it", 0),
    ("a lazy and unfunny comedy", 0),
    ("ugly images and an annoying score", 0),
    ("a depressing, miserable experience", 0),
    ("the director delivers a disaster", 0),
    ("slow, predictable and always dull", 0),
    ("a cynical and mean spirited tale", 0),
    ("terrible performances all around", 0),
    ("unfunny, stale and full of cliches", 0),
    ("a mess of forced emotion", 0),
    ("i would never watch it again", 0),
    ("a pointless, dishonest little film", 0),
    ("the ending is silly and unearned", 0),
    ("a waste of time for everyone", 0),
    ("a shallow and tiresome drama", 0),
]


EXAMPLE = os.path.join(harness.CHECKOUT, "examples", "bert_finetune.py")
SHARED_DATA = os.path.join(os.path.dirname(harness.CHECKOUT), "shared", "data", "rt-polarity")


def demo_data(folder, shared=SHARED_DATA):
    """The sentence-polarity directory `shared` if it exists, else `SENTENCES` as a TSV in `folder`."""
    if os.path.isdir(shared):
        return shared
    path = os.path.join(folder, "sentences.tsv")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{label}\t{text}\n" for text, label in SENTENCES)
    return path


def finetune_command(data, json_path):
    """The fine-tuning example with recomputation and accumulation, small settings."""
    return [sys.executable, EXAMPLE, "--data", data, "--recompute", "--accum-steps", "4",
            "--batch-size", "4", "--seq-len", "32", "--max-steps", "8", "--lr", "1e-4",
            "--json", json_path]


def finetune_demo(shared=SHARED_DATA):
    """Runs `examples/bert_finetune.py` (`finetune_command`) on `demo_data`; returns its results.

    Its output goes to this process's stdout and stderr.
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = demo_data(tmp, shared)
        out = os.path.join(tmp, "finetune.json")
        cmd = finetune_command(data, out)
        _progress("fine-tuning demo: python examples/bert_finetune.py " + " ".join(cmd[2:-2]))
        sys.stdout.flush()
        code = subprocess.run(cmd, env=harness.worker_env(**ENV)).returncode
        if code != 0 or not os.path.exists(out):
            raise RuntimeError(f"the fine-tuning demo (examples/bert_finetune.py) failed with "
                               f"exit code {code} (its output is above)")
        with open(out) as f:
            return json.load(f)


# --------------------------------------------------------------------------
# Command line.


_models = harness.name_list(tuple(SHAPES))
_policies = harness.name_list(POLICIES)


def parse_args(argv=None):
    """Parses the command line (see the module docstring); errors name what was expected."""
    parser = harness.parser(
        "benchmarks.batchfit",
        "recompute.plan on a bert4keras BERT: the policy, micro-batch and accumulation steps "
        "it chooses within a memory budget, and what the plan cost.",
    )
    parser.add_argument("--models", type=_models,
                        help=f"comma-separated, from {','.join(SHAPES)} "
                             f"(default {','.join(FULL['models'])}; --quick: minilm)")
    parser.add_argument("--seq-len", type=harness.positive_int,
                        help=f"sequence length (default {FULL['seq_len']}; --quick: {QUICK['seq_len']})")
    parser.add_argument("--budget-gib", type=harness.positive_float,
                        help=f"memory budget in GiB (default {FULL['budget_gib']:g}; "
                             f"--quick: {QUICK['budget_gib']:g})")
    parser.add_argument("--effective-batch", "--max-batch", dest="effective_batch",
                        type=harness.positive_int,
                        help=f"the batch of one update: the micro-batches planned are its "
                             f"divisors (default {FULL['effective_batch']}; --quick: "
                             f"{QUICK['effective_batch']}; --max-batch is its old name)")
    parser.add_argument("--policies", type=_policies,
                        help="comma-separated recomputation policies planned beside none, "
                             "from layer,block,attention,block_keep_ffn (default attention,block)")
    parser.add_argument("--batches", type=harness.int_list, default=(2, 4),
                        help="the two small micro-batches of the plan's line (default 2,4)")
    parser.add_argument("--memory", choices=("auto", "rss", "allocator"), default="auto",
                        help="what the plan measures (recompute.plan's `memory`; default auto)")
    parser.add_argument("--quick", action="store_true",
                        help="real MiniLM, seq 256, 2 GiB, effective batch 32, then a short run "
                             "of examples/bert_finetune.py --recompute --accum-steps 4 (a few "
                             "minutes on 2 cores); explicit options override it")
    parser.add_argument("--plot", metavar="PATH", default="batchfit.png",
                        help="PNG of the measured peaks vs micro-batch (default batchfit.png)")
    harness.add_output_arguments(parser, TOOL, workers=False)
    args = parser.parse_args(argv)
    harness.check_docs_page(parser, args.docs, TOOL)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.policies = args.policies or ("attention", "block")
    for name in ("json", "plot"):
        if getattr(args, name):
            harness.existing_folder(parser, f"--{name}", getattr(args, name))
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot: expected a path ending in .png, got {args.plot!r}")
    if len(args.batches) != 2:
        parser.error(f"--batches: expected two different positive integers such as 2,4, got "
                     f"{','.join(map(str, args.batches))!r}")
    if args.effective_batch < min(args.batches):
        parser.error(f"--effective-batch: expected at least the smallest of --batches "
                     f"{args.batches}, got {args.effective_batch}")
    return args


def main(argv=None):
    """Entry point of `python -m benchmarks.batchfit`; returns the exit code."""
    try:
        return _main(argv)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(argv=None):
    args = parse_args(argv)
    check_env()
    opts = dict(models=args.models, seq_len=args.seq_len, budget_gib=args.budget_gib,
                effective_batch=args.effective_batch, policies=args.policies,
                batches=args.batches, memory=args.memory)
    start_wall, start_cpu = time.time(), time.process_time()
    results = []
    for model in args.models:
        paths = minilm_paths() if model == "minilm" else None
        if paths is not None:
            _progress(f"real MiniLM weights: {paths['checkpoint_path']}")
        worker_paths = {k: v for k, v in (paths or {}).items() if k != "vocab_path"}
        results.append(plan_model(model, opts, worker_paths))
    with harness.report_to_docs(args.docs, TOOL, argv):
        print_report(results, opts)
    tune = None
    if args.quick:
        print("", flush=True)
        if minilm_paths() is None:
            _progress("no real MiniLM weights: the fine-tuning demo (examples/bert_finetune.py, "
                      "which needs them) is skipped")
        else:
            tune = finetune_demo()
    if args.plot:
        plot(results, opts, args.plot)
        _progress(f"plot written to {os.path.abspath(args.plot)}")
    _progress(f"done in {time.time() - start_wall:.0f} s wall, "
              f"{time.process_time() - start_cpu + _children_cpu():.0f} CPU s (all processes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(options=opts, results=[
                dict(model=r["model"], wall_s=r["wall_s"], cpu_s=r["cpu_s"],
                     plan=r["plan"].as_dict()) for r in results], finetune=tune), f, indent=2)
        _progress(f"results saved to {os.path.abspath(args.json)}")
    return 0


def _children_cpu():
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
