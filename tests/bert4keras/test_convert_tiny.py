"""recompute.bert4keras.converter on tiny random BERTs written by the tests:
HF name variants, the MLM/NSP heads, and every refused input named.

Own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1. bert4keras is imported inside
the tests only (test_bert4keras_patch.py checks it is not imported before its
own `patch()`); the MiniLM fixtures are in conftest.py.
"""

import json
import os
import zipfile

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import safetensors.numpy  # noqa: E402

from recompute.bert4keras import converter as hf_convert  # noqa: E402
from recompute.bert4keras.converter import convert  # noqa: E402

from tests.helpers import numpy_bert  # noqa: E402


TINY = dict(
    model_type="bert", vocab_size=40, hidden_size=16, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=24, hidden_act="gelu",
    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    max_position_embeddings=20, type_vocab_size=2, initializer_range=0.02,
    layer_norm_eps=1e-12,
)


def _tiny_weights(cfg, *, pooler=True, heads=False, seed=0):
    rng = np.random.default_rng(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    w = {}

    def dense(name, n_out, n_in):
        w[name + ".weight"] = rng.normal(0, 0.3, (n_out, n_in))
        w[name + ".bias"] = rng.normal(0, 0.1, (n_out,))

    def norm(name):
        w[name + ".weight"] = 1 + rng.normal(0, 0.1, (h,))
        w[name + ".bias"] = rng.normal(0, 0.1, (h,))

    w["embeddings.word_embeddings.weight"] = rng.normal(0, 0.5, (v, h))
    w["embeddings.position_embeddings.weight"] = rng.normal(0, 0.5, (cfg["max_position_embeddings"], h))
    w["embeddings.token_type_embeddings.weight"] = rng.normal(0, 0.5, (cfg["type_vocab_size"], h))
    norm("embeddings.LayerNorm")
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            dense(p + "attention.self." + part, h, h)
        dense(p + "attention.output.dense", h, h)
        norm(p + "attention.output.LayerNorm")
        dense(p + "intermediate.dense", i, h)
        dense(p + "output.dense", h, i)
        norm(p + "output.LayerNorm")
    if pooler:
        dense("pooler.dense", h, h)
    if heads:
        dense("cls.predictions.transform.dense", h, h)
        norm("cls.predictions.transform.LayerNorm")
        w["cls.predictions.bias"] = rng.normal(0, 0.1, (v,))
        dense("cls.seq_relationship", 2, h)
    return {k: val.astype(np.float32) for k, val in w.items()}


def _tiny_tokenizer(vocab_size):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens += list(letters[: (vocab_size - 5) // 2])
    tokens += ["##" + c for c in letters[: vocab_size - len(tokens)]]
    return {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(tokens[:5])],
        "normalizer": {"type": "BertNormalizer", "lowercase": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": {t: i for i, t in enumerate(tokens)}},
    }


def write_tiny(path, *, config=None, weights=None, rename=None, files=None):
    """A HF-format tiny BERT in the directory `path` (created); returns `path`."""
    cfg = dict(TINY, **(config or {}))
    weights = _tiny_weights(TINY) if weights is None else weights
    if rename:
        weights = {rename(k): v for k, v in weights.items()}
    os.makedirs(path, exist_ok=True)
    files = files or ("config.json", "model.safetensors", "tokenizer.json")
    if "config.json" in files:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    if "model.safetensors" in files:
        safetensors.numpy.save_file(weights, os.path.join(path, "model.safetensors"))
    if "tokenizer.json" in files:
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            json.dump(_tiny_tokenizer(cfg["vocab_size"]), f)
    return path


def _old_names(name):
    """BertForPreTraining naming of old checkpoints: `bert.` prefix, LayerNorm gamma/beta."""
    name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    return name if name.startswith("cls.") else "bert." + name


@pytest.mark.fast
def test_tiny_name_variants_and_heads_in_bert4keras(tmp_path):
    import tensorflow as tf
    from bert4keras.models import build_transformer_model

    weights = _tiny_weights(TINY, heads=True, seed=1)
    weights["cls.predictions.decoder.weight"] = weights["embeddings.word_embeddings.weight"]
    weights["cls.predictions.decoder.bias"] = weights["cls.predictions.bias"]
    src = tmp_path / "hf.zip"
    write_tiny(tmp_path / "hf", weights=weights, rename=_old_names)
    with zipfile.ZipFile(src, "w") as zf:  # a zip with the files in a folder
        for name in os.listdir(tmp_path / "hf"):
            zf.write(tmp_path / "hf" / name, "tiny-bert/" + name)
    bert = convert(src, tmp_path / "out")
    with open(os.path.join(tmp_path / "out", "hf_convert.json")) as f:
        assert json.load(f)["parts"] == ["encoder", "pooler", "mlm", "nsp"]

    model = build_transformer_model(
        bert.config_path, bert.checkpoint_path, with_mlm=True, with_nsp=True
    )
    hidden = model.get_layer("Transformer-1-FeedForward-Norm").output
    model = tf.keras.Model(model.inputs, [hidden] + model.outputs)
    token_ids = np.array([[2, 5, 9, 21, 7, 3], [2, 6, 3, 0, 0, 0]])
    segment_ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    hidden, nsp, mlm = (t.numpy() for t in model([token_ids, segment_ids], training=False))

    ref = numpy_bert.NumpyBert.from_hf(str(src))
    want, pooled = ref(token_ids, segment_ids, (token_ids > 0).astype(np.int64))
    mask = token_ids > 0
    assert np.abs(hidden[mask] - want[mask]).max() <= 1e-4 * np.abs(want).max()

    w = {k: v.astype(np.float64) for k, v in weights.items()}
    logits = pooled @ w["cls.seq_relationship.weight"].T + w["cls.seq_relationship.bias"]
    want_nsp = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(nsp, want_nsp, atol=1e-5)
    t = want @ w["cls.predictions.transform.dense.weight"].T + w["cls.predictions.transform.dense.bias"]
    t = ref._norm(numpy_bert.gelu_erf(t), "cls.predictions.transform.LayerNorm")
    logits = t @ w["embeddings.word_embeddings.weight"].T + w["cls.predictions.bias"]
    want_mlm = np.exp(logits - logits.max(-1, keepdims=True))
    want_mlm /= want_mlm.sum(-1, keepdims=True)
    np.testing.assert_allclose(mlm[mask], want_mlm[mask], atol=1e-5)


def test_tiny_without_pooler_loads_plain_and_fails_with_pool(tmp_path):
    import tensorflow as tf
    from bert4keras.models import build_transformer_model

    # Every activation the converter writes resolves in bert4keras.
    for name in set(hf_convert.ACTIVATIONS.values()):
        assert callable(tf.keras.activations.get(name)), name
    # HF "gelu_new" (tanh GELU) -> bert4keras "gelu_tanh".
    src = write_tiny(tmp_path / "hf", config={"hidden_act": "gelu_new"},
                     weights=_tiny_weights(TINY, pooler=False, seed=2))
    bert = convert(src, tmp_path / "out")
    model = build_transformer_model(bert.config_path, bert.checkpoint_path)
    token_ids = np.array([[2, 8, 11, 30, 3], [2, 9, 3, 0, 0]])
    segment_ids = np.zeros_like(token_ids)
    hidden = model([token_ids, segment_ids], training=False).numpy()
    want, pooled = numpy_bert.NumpyBert.from_hf(str(src))(token_ids, segment_ids, token_ids > 0)
    assert pooled is None
    mask = token_ids > 0
    assert np.abs(hidden[mask] - want[mask]).max() <= 1e-4 * np.abs(want).max()
    with pytest.raises(tf.errors.NotFoundError, match="bert/pooler/dense/kernel"):
        build_transformer_model(bert.config_path, bert.checkpoint_path, with_pool=True)


def test_missing_model_safetensors_is_named(tmp_path, minilm_zip):
    src = tmp_path / "minilm"
    src.mkdir()
    with zipfile.ZipFile(minilm_zip) as zf:  # a copy of MiniLM without its weights
        for name in ("config.json", "tokenizer.json"):
            (src / name).write_bytes(zf.read(name))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is missing"):
        convert(src, tmp_path / "out")
    with zipfile.ZipFile(tmp_path / "nomodel.zip", "w") as zf:
        for name in ("config.json", "tokenizer.json"):
            zf.write(src / name, name)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        convert(tmp_path / "nomodel.zip", tmp_path / "out")
    tiny = write_tiny(tmp_path / "tiny", files=("config.json", "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
        convert(tiny, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("config, match", [
    ({"model_type": "roberta"}, r"model_type 'bert'.*received model_type 'roberta'"),
    ({"hidden_act": "gelu_10"}, r"hidden_act .*received 'gelu_10'"),
    ({"layer_norm_eps": 1e-5}, r"layer_norm_eps to be 1e-12.*received 1e-05"),
    ({"position_embedding_type": "relative_key"}, r"'absolute'.*received 'relative_key'"),
    ({"num_attention_heads": 5}, r"multiple of num_attention_heads"),
])
def test_unsupported_configs_are_refused(tmp_path, config, match):
    src = write_tiny(tmp_path / "hf", config=config)
    with pytest.raises(ValueError, match=match):
        convert(src, tmp_path / "out")
    assert os.listdir(tmp_path) == ["hf"]


def test_tensor_problems_are_named(tmp_path):
    def check(weights, match, **kwargs):
        src = write_tiny(tmp_path / "hf", weights=weights, **kwargs)
        with pytest.raises(ValueError, match=match):
            convert(src, tmp_path / "out")
        assert os.listdir(tmp_path) == ["hf"]

    w = _tiny_weights(TINY)
    missing = {k: v for k, v in w.items() if k != "encoder.layer.1.attention.self.key.bias"}
    check(missing, r"missing: 'encoder\.layer\.1\.attention\.self\.key\.bias'")
    check(dict(w, **{"encoder.layer.2.output.dense.weight": w["encoder.layer.1.output.dense.weight"]}),
          r"unexpected tensors: 'encoder\.layer\.2\.output\.dense\.weight'")
    check(dict(w, **{"bert.encoder.layer.1.output.dense.bias": w["encoder.layer.1.output.dense.bias"]}),
          r"under two names")
    bad = dict(w, **{"encoder.layer.0.intermediate.dense.weight": np.zeros((16, 24), np.float32)})
    check(bad, r"'encoder\.layer\.0\.intermediate\.dense\.weight': expected \(24, 16\), received \(16, 24\)")
    partial = dict(w, **{"cls.seq_relationship.weight": np.zeros((2, 16), np.float32)})
    check(partial, r"nsp head, partly present.*'cls\.seq_relationship\.bias'")
    untied = dict(_tiny_weights(TINY, heads=True))
    untied["cls.predictions.decoder.weight"] = untied["embeddings.word_embeddings.weight"] + 1
    check(untied, r"'cls\.predictions\.decoder\.weight' to equal bert/embeddings/word_embeddings")


def test_out_dir_is_not_overwritten_unless_asked(tmp_path, monkeypatch):
    src = write_tiny(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert(src, out)
    assert os.listdir(out) == ["keep.txt"]

    # A conversion failing while writing leaves no trace, and the old out_dir intact.
    def fail(prefix, variables):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_convert, "write_checkpoint", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(src, out, overwrite=True)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(src, tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]
    assert os.listdir(out) == ["keep.txt"]
    monkeypatch.undo()

    bert = convert(src, out, overwrite=True)
    assert "keep.txt" not in os.listdir(out) and os.path.isfile(bert.checkpoint_path + ".index")
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]
    # An empty out_dir is fine; the CLI refuses a non-empty one.
    (tmp_path / "empty").mkdir()
    convert(src, tmp_path / "empty")
    assert hf_convert.main([str(src), str(out)]) == 1
