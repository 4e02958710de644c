"""What the fine-tuning examples share: sentence-classification data (read, checked,
split), their common options and argument types (whose errors say what was expected and
received), the training clock, the results report, peak memory and `main`.

`examples/bert_finetune.py` (bert4keras) and `examples/keras_hub_finetune.py`
(keras-hub) import it from their own folder.

Data: either a directory in the sentence-polarity layout -- files `*.pos` and
`*.neg`, one sentence a line, UTF-8 (label 1 and 0) -- or a TSV file of
`label<TAB>text` lines with integer labels 0..C-1. Bad data raises `DataError`
naming the file and the line, before anything is built.
"""

import argparse
import json
import math
import random
import resource
import sys
import time
from pathlib import Path

RT_POLARITY_URL = "https://www.cs.cornell.edu/people/pabo/movie-review-data/ (sentence polarity dataset v1.0)"


class DataError(ValueError):
    """Missing or malformed training data (the message names the file and line)."""


# ---------------------------------------------------------------------------
# Data


def _read_lines(path):
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"Cannot read data file {path}: {e.strerror}") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # final newline
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}, line {number}: not UTF-8 ({e.reason} at byte {e.start}). "
                "Data files must be UTF-8 text."
            ) from None
        out.append((number, text.rstrip("\r")))
    return out


def _read_polarity_dir(directory):
    files = sorted(directory.glob("*.pos")) + sorted(directory.glob("*.neg"))
    if not files:
        raise DataError(
            f"Data directory {directory} has no *.pos or *.neg file. Expected the "
            "sentence-polarity layout (one sentence a line; *.pos = label 1, "
            f"*.neg = label 0), e.g. rt-polarity.pos/.neg from {RT_POLARITY_URL}; "
            "or pass a TSV file of `label<TAB>text` lines."
        )
    texts, labels = [], []
    for path in files:
        label = 1 if path.suffix == ".pos" else 0
        lines = _read_lines(path)
        if not lines:
            raise DataError(f"{path} is empty: expected one sentence a line.")
        for number, text in lines:
            if not text.strip():
                raise DataError(f"{path}, line {number}: empty line; expected one sentence a line.")
            texts.append(text.strip())
            labels.append(label)
    if len(set(labels)) < 2:
        kind = "*.pos" if labels[0] == 1 else "*.neg"
        raise DataError(
            f"Data directory {directory} has only {kind} files: a classifier needs "
            "both *.pos and *.neg sentences."
        )
    return texts, labels


def _read_tsv(path):
    texts, labels = [], []
    lines = _read_lines(path)
    if not lines:
        raise DataError(f"{path} is empty: expected `label<TAB>text` lines.")
    for number, line in lines:
        if not line.strip():
            raise DataError(f"{path}, line {number}: empty line; expected `label<TAB>text`.")
        label, tab, text = line.partition("\t")
        if not tab:
            raise DataError(
                f"{path}, line {number}: no tab; expected `label<TAB>text`. "
                f"Received: {line[:60]!r}"
            )
        try:
            value = int(label)
        except ValueError:
            value = -1
        if value < 0 or label.strip() != label:
            raise DataError(
                f"{path}, line {number}: the label must be an integer >= 0. "
                f"Received: {label[:30]!r}"
            )
        if not text.strip():
            raise DataError(f"{path}, line {number}: the text after the tab is empty.")
        texts.append(text.strip())
        labels.append(value)
    if len(set(labels)) < 2:
        raise DataError(f"{path}: every line has label {labels[0]}; a classifier needs at least 2 classes.")
    return texts, labels


def load_data(path):
    """(texts, labels) from a sentence-polarity directory or a `label<TAB>text` TSV file.

    Raises `DataError` naming the file (and line) for missing or malformed data.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"--data {path} does not exist. Expected a directory of *.pos/*.neg files "
            f"(the sentence polarity data set: {RT_POLARITY_URL}) or a TSV file of "
            "`label<TAB>text` lines."
        )
    return _read_polarity_dir(path) if path.is_dir() else _read_tsv(path)


def split(texts, labels, valid_fraction, seed):
    """Shuffled (train, held-out) split; each part is a list of (text, label)."""
    pairs = list(zip(texts, labels))
    random.Random(seed).shuffle(pairs)
    n_valid = max(1, int(round(len(pairs) * valid_fraction)))
    if n_valid >= len(pairs):
        raise DataError(
            f"{len(pairs)} examples are too few for --valid-fraction {valid_fraction}: "
            "nothing would be left to train on."
        )
    return pairs[n_valid:], pairs[:n_valid]


# ---------------------------------------------------------------------------
# Arguments


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1 or str(value) != text.strip():
            raise argparse.ArgumentTypeError(f"`{name}` must be an integer >= 1. Received: {name}={text}")
        return value

    return parse


def _float_option(flag, accept, expected):
    """An argparse type: a float for which `accept(value)` holds, else an error naming `flag`."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = float("nan")  # accepted by none of the checks below
        if not accept(value):
            raise argparse.ArgumentTypeError(f"`{flag}` must be {expected}. Received: {text}")
        return value

    return parse


_fraction = _float_option("--valid-fraction", lambda v: 0.0 < v < 1.0, "in (0, 1)")
_rate = _float_option("--dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)")
_learning_rate = _float_option("--lr", lambda v: v > 0.0 and math.isfinite(v), "a number > 0")


def peak_rss_mib():
    """Peak resident memory of this process (VmHWM), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------
# What both fine-tuning scripts do around their model


def add_training_arguments(p):
    """The data, batching, schedule and output options both examples take."""
    p.add_argument("--data", required=True,
                   help="directory of *.pos/*.neg files (one sentence a line) or a TSV of label<TAB>text")
    p.add_argument("--accum-steps", type=_positive_int("--accum-steps"), default=1,
                   help="micro-batches per weight update (AccumOptimizer); default 1 = plain Adam")
    p.add_argument("--batch-size", type=_positive_int("--batch-size"), default=32, help="micro-batch size")
    p.add_argument("--seq-len", type=_positive_int("--seq-len"), default=64,
                   help="tokens per sentence, [CLS] and [SEP] included")
    p.add_argument("--epochs", type=_positive_int("--epochs"), default=1)
    p.add_argument("--max-steps", type=_positive_int("--max-steps"), default=None,
                   help="stop after this many weight updates (each of --accum-steps micro-batches)")
    p.add_argument("--lr", type=_learning_rate, default=5e-5, help="Adam learning rate")
    p.add_argument("--valid-fraction", type=_fraction, default=0.1, help="held-out share of the data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def parse_training_arguments(p, argv):
    """`p.parse_args(argv)`, with the checks that span options."""
    args = p.parse_args(argv)
    if args.seq_len < 3:
        p.error(f"`--seq-len` must be >= 3 ([CLS], a token, [SEP]). Received: --seq-len={args.seq_len}")
    return args


def steady_clock(callback_base):
    """A `callback_base` (Keras's or tf_keras's `Callback`) timing training after the first
    micro-step (tracing excluded); `elapsed()` gives (wall s, CPU s, micro-steps timed)."""

    class Clock(callback_base):
        def __init__(self):
            super().__init__()
            self.start = None
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            if self.start is None:
                self.start = (time.perf_counter(), time.process_time())
            else:
                self.steps += 1

        def elapsed(self):
            if not self.steps:
                return float("nan"), float("nan"), 0
            return (time.perf_counter() - self.start[0], time.process_time() - self.start[1], self.steps)

    return Clock()


def report(args, evaluated, held_out, optimizer, clock, train_micro_steps, **first):
    """The results dict of a fine-tune (`first` leads it), printed as one line.

    `evaluated`: (held-out loss, held-out accuracy); `clock`: a `steady_clock`.
    """
    wall, cpu, micro_steps = clock.elapsed()
    samples = micro_steps * args.batch_size
    loss, accuracy = evaluated
    results = {
        **first,
        "held_out_accuracy": float(accuracy),
        "held_out_loss": float(loss),
        "held_out_examples": held_out,
        "train_micro_steps": train_micro_steps,
        "weight_updates": int(optimizer.iterations.numpy()),
        "samples_per_s": samples / wall if samples else float("nan"),
        "cpu_s_per_sample": cpu / samples if samples else float("nan"),
        "peak_rss_mib": peak_rss_mib(),
        "recompute": bool(args.recompute),
        "accum_steps": args.accum_steps,
        "batch_size": args.batch_size,
        "effective_batch": args.batch_size * args.accum_steps,
        "seq_len": args.seq_len,
    }
    print(
        f"held-out accuracy {results['held_out_accuracy']:.4f} on {held_out} sentences | "
        f"{results['weight_updates']} weight updates | "
        f"{results['samples_per_s']:.1f} samples/s ({results['cpu_s_per_sample'] * 1000:.1f} CPU ms/sample) | "
        f"peak memory {results['peak_rss_mib']:.0f} MiB (VmHWM)",
        flush=True,
    )
    return results


def main(parse_args, run, argv=None, errors=(DataError, FileNotFoundError)):
    """Runs `run(parse_args(argv))`; `errors` print "error: ..." and give exit status 2;
    `--json PATH` saves the results. Returns the exit status."""
    args = parse_args(argv)
    try:
        results = run(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
