"""recompute.bert4keras.converter on the real MiniLM: the files, the checkpoint
layout, outputs equal to a NumPy BERT, and reuse of a finished conversion.

Own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1. bert4keras is imported inside
the tests only (test_bert4keras_patch.py checks it is not imported before its
own `patch()`); the MiniLM fixtures are in conftest.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

from recompute.bert4keras import converter as hf_convert  # noqa: E402
from recompute.bert4keras.converter import ConvertedBert, minilm  # noqa: E402

from tests.helpers.sentences import ROOT, rt_sentences  # noqa: E402


def test_minilm_files_and_checkpoint_layout(converted, reference):
    import tensorflow as tf

    assert isinstance(converted, ConvertedBert)
    out_dir = os.path.dirname(converted.config_path)
    assert converted.checkpoint_path == os.path.join(out_dir, "bert_model.ckpt")
    assert sorted(os.listdir(out_dir)) == sorted([
        "bert_config.json", "vocab.txt", "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001", "checkpoint", "hf_convert.json",
    ])
    with open(converted.config_path) as f:
        cfg = json.load(f)
    assert cfg == {
        "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 12, "intermediate_size": 1536, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512, "type_vocab_size": 2, "initializer_range": 0.02,
    }
    with open(converted.vocab_path, encoding="utf-8") as f:
        vocab = f.read().split("\n")
    assert len(vocab) == 30523 and vocab[-1] == ""
    assert vocab[:1] + vocab[100:104] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

    names = dict(tf.train.list_variables(converted.checkpoint_path))
    layer = [
        "attention/self/query/kernel", "attention/self/query/bias",
        "attention/self/key/kernel", "attention/self/key/bias",
        "attention/self/value/kernel", "attention/self/value/bias",
        "attention/output/dense/kernel", "attention/output/dense/bias",
        "attention/output/LayerNorm/gamma", "attention/output/LayerNorm/beta",
        "intermediate/dense/kernel", "intermediate/dense/bias",
        "output/dense/kernel", "output/dense/bias",
        "output/LayerNorm/gamma", "output/LayerNorm/beta",
    ]
    expected = {
        "bert/embeddings/word_embeddings", "bert/embeddings/position_embeddings",
        "bert/embeddings/token_type_embeddings", "bert/embeddings/LayerNorm/gamma",
        "bert/embeddings/LayerNorm/beta", "bert/pooler/dense/kernel", "bert/pooler/dense/bias",
    } | {f"bert/encoder/layer_{i}/{n}" for i in range(6) for n in layer}
    assert set(names) == expected
    assert names["bert/encoder/layer_3/intermediate/dense/kernel"] == [384, 1536]
    w = reference.w
    load = tf.train.load_variable
    ckpt = converted.checkpoint_path
    np.testing.assert_array_equal(
        load(ckpt, "bert/encoder/layer_3/intermediate/dense/kernel"),
        w["encoder.layer.3.intermediate.dense.weight"].T.astype(np.float32))
    np.testing.assert_array_equal(
        load(ckpt, "bert/encoder/layer_5/output/LayerNorm/beta"),
        w["encoder.layer.5.output.LayerNorm.bias"].astype(np.float32))
    # The checkpoint state file: the directory works as a checkpoint too.
    assert tf.train.latest_checkpoint(out_dir) == ckpt


def test_minilm_matches_numpy_bert(converted, reference):
    import tensorflow as tf
    from bert4keras.backend import gelu_erf
    from bert4keras.models import build_transformer_model
    from bert4keras.snippets import sequence_padding
    from bert4keras.tokenizers import Tokenizer

    # bert4keras's "gelu" is the erf GELU MiniLM (HF "gelu") was trained with.
    # (`recompute.bert4keras.patch()` wraps it: the same function, see `_patch._gelu`.)
    gelu = tf.keras.activations.get("gelu")
    assert getattr(gelu, "__wrapped__", gelu) is gelu_erf

    tokenizer = Tokenizer(converted.vocab_path, do_lower_case=True)
    sentences = rt_sentences(4) + ["Short.", "A pair of sentences, the second one"]
    encoded = [tokenizer.encode(s) for s in sentences[:-1]]
    encoded.append(tokenizer.encode(sentences[-1], "is segment one."))
    token_ids = sequence_padding([e[0] for e in encoded])
    segment_ids = sequence_padding([e[1] for e in encoded])
    mask = token_ids > 0  # bert4keras masks token id 0 ([PAD]) as padding
    assert mask.sum(1).min() < token_ids.shape[1]  # there is padding
    assert segment_ids.max() == 1

    want_hidden, want_pooled = reference(token_ids, segment_ids, mask.astype(np.int64))

    encoder = build_transformer_model(converted.config_path, converted.checkpoint_path)
    hidden = encoder([token_ids, segment_ids], training=False).numpy()
    scale = np.abs(want_hidden[mask]).max()
    err = np.abs(hidden[mask] - want_hidden[mask]).max()
    print(f"MiniLM last hidden states: max abs diff {err:.3g}, scale {scale:.3g}")
    assert err <= 1e-4 * scale

    # with_pool=True loads the pooler, which is HF's: tanh(dense(h[CLS])).
    pooler = build_transformer_model(
        converted.config_path, converted.checkpoint_path, with_pool=True
    )
    pooled = pooler([token_ids, segment_ids], training=False).numpy()
    err = np.abs(pooled - want_pooled).max()
    print(f"MiniLM pooled: max abs diff {err:.3g}, scale {np.abs(want_pooled).max():.3g}")
    assert err <= 1e-4 * np.abs(want_pooled).max()


def test_minilm_reuses_a_complete_conversion(converted, minilm_zip):
    out_dir = os.path.dirname(converted.config_path)
    marker = os.path.join(out_dir, "hf_convert.json")
    before = os.stat(marker).st_mtime_ns
    assert minilm(out_dir) == converted
    assert os.stat(marker).st_mtime_ns == before
    assert hf_convert._is_conversion_of(out_dir, minilm_zip)
    with open(marker) as f:
        data = json.load(f)
    assert data["parts"] == ["encoder", "pooler"] and data["do_lower_case"] is True
    stale = dict(data, source_size=data["source_size"] + 1)
    other = os.path.join(os.path.dirname(out_dir), "stale")
    os.makedirs(other)
    with open(os.path.join(other, "hf_convert.json"), "w") as f:
        json.dump(stale, f)
    assert not hf_convert._is_conversion_of(other, minilm_zip)


def test_minilm_cli_reuses_conversion(converted):
    out_dir = os.path.dirname(converted.config_path)
    before = os.stat(os.path.join(out_dir, "hf_convert.json")).st_mtime_ns
    run = subprocess.run(
        [sys.executable, "-m", "recompute.bert4keras.converter", "--minilm", out_dir],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"checkpoint_path={converted.checkpoint_path}" in run.stdout
    assert "bert_model.ckpt.index" in run.stdout
    assert os.stat(os.path.join(out_dir, "hf_convert.json")).st_mtime_ns == before


# --------------------------------------------------------------------------
# Tokenizer


def test_minilm_refuses_a_default_folder_it_did_not_write(tmp_path, monkeypatch):
    """The default cache folder is the user's once it holds something the converter did
    not write (no hf_convert.json): refused, nothing removed (issue 24, R6's rule)."""
    default = tmp_path / "all-MiniLM-L6-v2-google"
    default.mkdir()
    (default / "notes.txt").write_text("mine")
    monkeypatch.setattr(hf_convert, "DEFAULT_MINILM_DIR", str(default))
    with pytest.raises(FileExistsError, match="holds files"):
        minilm()
    assert sorted(os.listdir(default)) == ["notes.txt"]


def test_minilm_refuses_a_conversion_with_a_file_added(tmp_path):
    """A folder holding a conversion's marker and a file it does not list is the user's:
    refused, nothing removed."""
    out = tmp_path / "converted"
    out.mkdir()
    (out / hf_convert.MARKER_FILE).write_text(json.dumps({"files": [hf_convert.MARKER_FILE]}))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files"):
        minilm(out)
    assert sorted(os.listdir(out)) == sorted([hf_convert.MARKER_FILE, "notes.txt"])
