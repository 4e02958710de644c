"""recompute.keras_hub's preset folders: `hf_preset` and `minilm_preset` write, replace
and remove only what they wrote themselves (a folder carrying their marker file and
nothing else); a user's folder is refused and left as it was, a user's `<out_dir>.partial`
is never touched, a failed write leaves nothing behind. (No keras-hub needed: the
writing is plain files; loading the real preset is tests/helpers/keras_hub_checks.py.)"""

import json
import os

import pytest

from recompute.keras_hub import hf_preset, minilm_preset
from recompute.keras_hub.preset import MARKER_FILE


def _fake_hf_bert(path, weights=b"not really tensors"):
    """A directory with the files `hf_preset` copies (their contents are not read as tensors)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (path / "model.safetensors").write_bytes(weights)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"])}
    (path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "WordPiece", "vocab": vocab},
        "normalizer": {"lowercase": True},
    }))
    return path


def _tree(path):
    """Every file under `path` with its bytes."""
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(path) for f in files}


def _siblings(path):
    return sorted(os.listdir(os.path.dirname(path)))


def _users_folder(path):
    """A user's own preset-like folder (not written by the project) with a note beside it."""
    path.mkdir()
    (path / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (path / "model.safetensors").write_bytes(b"the user's own weights")
    (path / "notes.txt").write_text("my notes")
    return path


def test_hf_preset_writes_a_marked_preset_and_nothing_beside_it(tmp_path):
    src = _fake_hf_bert(tmp_path / "src")
    out = tmp_path / "out"
    assert hf_preset(src, out) == str(out)
    names = sorted(os.listdir(out))
    assert names == sorted(["config.json", "model.safetensors", "vocab.txt",
                            "tokenizer_config.json", MARKER_FILE])
    with open(out / MARKER_FILE, encoding="utf-8") as f:
        assert sorted(json.load(f)["files"]) == names
    assert (out / "vocab.txt").read_text().split() == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"]
    assert _siblings(out) == ["out", "src"]  # no temporary folder left


def test_hf_preset_replaces_only_a_preset_it_wrote(tmp_path):
    out = tmp_path / "out"
    hf_preset(_fake_hf_bert(tmp_path / "a", b"weights a"), out)
    hf_preset(_fake_hf_bert(tmp_path / "b", b"weights b"), out)
    assert (out / "model.safetensors").read_bytes() == b"weights b"
    assert _siblings(out) == ["a", "b", "out"]
    # A preset it wrote, to which the user added a file, is the user's now: refused, kept.
    (out / "notes.txt").write_text("my notes")
    before = _tree(out)
    with pytest.raises(FileExistsError, match="notes.txt"):
        hf_preset(_fake_hf_bert(tmp_path / "c", b"weights c"), out)
    assert _tree(out) == before
    assert _siblings(out) == ["a", "b", "c", "out"]


@pytest.mark.parametrize("what", ["folder", "file"])
def test_hf_preset_refuses_a_users_out_dir_and_leaves_it(tmp_path, what):
    src = _fake_hf_bert(tmp_path / "src")
    out = tmp_path / "out"
    if what == "folder":
        _users_folder(out)
    else:
        out.write_text("a file")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match="Received: out_dir="):
        hf_preset(src, out)
    assert _tree(tmp_path) == before
    assert _siblings(out) == ["out", "src"]


def test_hf_preset_leaves_a_users_partial_folder_alone(tmp_path):
    src = _fake_hf_bert(tmp_path / "src")
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "keep.txt").write_text("the user's")
    hf_preset(src, out)
    assert _tree(partial) == {"keep.txt": b"the user's"}
    assert _siblings(out) == ["out", "out.partial", "src"]


def test_hf_preset_that_fails_leaves_nothing(tmp_path):
    src = _fake_hf_bert(tmp_path / "src")
    (src / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="WordPiece"):
        hf_preset(src, out)
    assert _siblings(out) == ["src"]


def _minilm_size():
    import zipfile

    from recompute.bert4keras.converter import minilm_zip

    try:
        src = minilm_zip()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    with zipfile.ZipFile(src) as zf:
        return next(i.file_size for i in zf.infolist() if i.filename.endswith("model.safetensors"))


def test_minilm_preset_refuses_a_users_folder_and_leaves_it(tmp_path):
    _minilm_size()
    out = _users_folder(tmp_path / "mine")
    before = _tree(out)
    with pytest.raises(FileExistsError, match="notes.txt") as info:
        minilm_preset(out)
    assert "Received: out_dir=" in str(info.value) and MARKER_FILE in str(info.value)
    assert _tree(out) == before
    assert _siblings(out) == ["mine"]


def test_minilm_preset_refreshes_a_stale_preset_it_wrote_and_reuses_a_current_one(tmp_path):
    size = _minilm_size()
    out = tmp_path / "minilm"
    hf_preset(_fake_hf_bert(tmp_path / "old", b"an older preset"), out)
    partial = tmp_path / "minilm.partial"
    partial.mkdir()
    (partial / "keep.txt").write_text("the user's")
    assert minilm_preset(out) == str(out)
    assert os.path.getsize(out / "model.safetensors") == size
    assert MARKER_FILE in os.listdir(out)
    assert _tree(partial) == {"keep.txt": b"the user's"}
    assert _siblings(out) == ["minilm", "minilm.partial", "old"]
    mtime = os.stat(out / "model.safetensors").st_mtime_ns
    assert minilm_preset(out) == str(out)  # current: reused, not rewritten
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime
    (out / "notes.txt").write_text("my notes")  # reusing deletes nothing: a note is fine
    assert minilm_preset(out) == str(out)
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime
    assert (out / "notes.txt").read_text() == "my notes"
