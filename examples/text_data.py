"""What the fine-tuning examples share: sentence-classification data (read, checked,
split), argument types whose errors say what was expected and received, peak memory.

`examples/bert_finetune.py` (bert4keras) and `examples/keras_hub_finetune.py`
(keras-hub) import it from their own folder.

Data: either a directory in the sentence-polarity layout -- files `*.pos` and
`*.neg`, one sentence a line, UTF-8 (label 1 and 0) -- or a TSV file of
`label<TAB>text` lines with integer labels 0..C-1. Bad data raises `DataError`
naming the file and the line, before anything is built.
"""

import argparse
import math
import random
import resource
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


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"`--valid-fraction` must be in (0, 1). Received: {text}")
    return value


def _rate(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"`--dropout` must be in [0, 1). Received: {text}")
    return value


def _learning_rate(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"`--lr` must be a number > 0. Received: {text}")
    return value


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
