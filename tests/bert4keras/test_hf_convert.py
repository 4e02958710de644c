"""recompute.bert4keras.converter: a HF BERT converted for bert4keras computes what a NumPy BERT computes.

Own process: TF_KERAS=1 TF_USE_LEGACY_KERAS=1. bert4keras is imported inside
the tests only (test_bert4keras_patch.py checks it is not imported before its
own `patch()`).
"""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)", allow_module_level=True)

import safetensors.numpy  # noqa: E402

from recompute.bert4keras import converter as hf_convert  # noqa: E402
from recompute.bert4keras.converter import ConvertedBert, convert, minilm  # noqa: E402

from tests.helpers import numpy_bert  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RT_POLARITY = os.path.join(ROOT, "..", "shared", "data", "rt-polarity")

BUILTIN_SENTENCES = [
    "the rock is destined to be the 21st century's new \" conan \" .",
    "simplistic , silly and tedious .",
    "A gorgeously elaborate continuation of \"The Lord of the Rings\" trilogy.",
    "It's so laddish and juvenile, only teenage boys could possibly find it funny.",
    "Effective but too-tepid biopic.",
    "If you sometimes like to go to the movies to have fun, Wasabi is a good place to start.",
    "Emerges as something rare, an issue movie that's so honest and keenly observed.",
    "The film is strictly routine.",
]

# Strings on which both tokenizers agree, chosen to be hard.
TRICKY = [
    "Café naïve résumé — déjà vu!",
    "ÉCOLE Über STRASSE Straße İstanbul",
    "Hello, World!!! 1,234.56 $7.89 3rd 2nd-place #1 @user 50% (a) [b] {c}",
    "中文字符测试 and 日本語のテキスト 한국어",
    "supercalifragilisticexpialidocious xyzzyqwkpfh zzzzzzzzzzz",
    "MiXeD CaSe TeXt WITH ALL CAPS",
    "don't won't it's y'all o'clock",
    "emoji 😀 test ☃ ♥",
    "tab\there\nnewline\r\nwindows  double  space",
    "a\x0cb a\x0bb a\u2028b a\x85b a\u200bb a\u00adb \x00a\ufffdb",
    "ﬁne ligature Ⅻ ½ ² ﬀ",
    "x" * 100,
    "",
]

# Documented differences (see the module docstring of recompute.bert4keras.converter).
KNOWN_DIFFERENCES = [
    "[MASK] [CLS] [SEP]",
    "ΟΔΟΣ",
    "a\ue000b",
    "x" * 150,
    "a\u2e55b",
]


def _rt_sentences(per_file):
    """`per_file` lines spread over each rt-polarity file, or the built-in sentences."""
    lines = []
    for name in ("rt-polarity.pos", "rt-polarity.neg"):
        path = os.path.join(RT_POLARITY, name)
        if not os.path.isfile(path):
            return list(BUILTIN_SENTENCES)
        with open(path, encoding="utf-8") as f:
            file_lines = [line.strip() for line in f if line.strip()]
        step = max(1, len(file_lines) // per_file)
        lines += file_lines[::step][:per_file]
    return lines


@pytest.fixture(scope="module")
def minilm_zip():
    return hf_convert.minilm_zip()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return minilm(tmp_path_factory.mktemp("minilm") / "google")


@pytest.fixture(scope="module")
def reference(minilm_zip):
    return numpy_bert.NumpyBert.from_hf(minilm_zip)


# --------------------------------------------------------------------------
# The real MiniLM


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
    assert tf.keras.activations.get("gelu") is gelu_erf

    tokenizer = Tokenizer(converted.vocab_path, do_lower_case=True)
    sentences = _rt_sentences(4) + ["Short.", "A pair of sentences, the second one"]
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


@pytest.fixture(scope="module")
def tokenizers_pair(converted, minilm_zip, tmp_path_factory):
    import tokenizers
    from bert4keras.tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    with zipfile.ZipFile(minilm_zip) as zf:
        path.write_bytes(zf.read("tokenizer.json"))
    hf = tokenizers.Tokenizer.from_file(str(path))
    hf.no_padding()  # tokenizer.json pads and truncates to 128
    hf.no_truncation()
    return hf, Tokenizer(converted.vocab_path, do_lower_case=True)


def test_tokenizer_matches_hf_tokenizers(tokenizers_pair):
    hf, b4k = tokenizers_pair
    texts = _rt_sentences(100) + TRICKY
    differ = [t for t in texts if hf.encode(t).ids != b4k.encode(t)[0]]
    print(f"tokenizer: {len(texts) - len(differ)} of {len(texts)} texts give the same ids")
    assert not differ, [(t, hf.encode(t).tokens, b4k.tokenize(t)) for t in differ[:5]]
    pairs = list(zip(texts[:20], texts[20:40]))
    for first, second in pairs:
        want = hf.encode(first, second)
        assert b4k.encode(first, second) == (want.ids, want.type_ids)


@pytest.mark.xfail(strict=True, reason="documented tokenizer difference (see the converter's docstring)")
@pytest.mark.parametrize("text", KNOWN_DIFFERENCES, ids=lambda t: repr(t[:12]))
def test_tokenizer_known_differences(tokenizers_pair, text):
    """Documented differences: each must still differ (strict xfail), so an
    upstream fix shows up as a failure and the documentation gets updated."""
    hf, b4k = tokenizers_pair
    assert hf.encode(text).ids == b4k.encode(text)[0], (
        f"HF {hf.encode(text).tokens[:6]}, bert4keras {b4k.tokenize(text)[:6]}"
    )


# --------------------------------------------------------------------------
# A tiny random BERT: name variants, heads, errors

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
