"""The registry of keras-hub's Transformer blocks that `patch()` recomputes: `BLOCKS`,
read from the table `blocks.txt` beside this module.

One row per block class of keras-hub 0.32 whose `call` is patched (a
subclass that inherits `call` is covered by its base's row: Whisper's
encoder and decoder, Llama3's decoder). Each row says

- `path`: where the class lives in keras-hub (a module path and a class
  name; a class missing from the installed keras-hub is skipped);
- `cache`: the arguments of `call` that carry a generation cache. A call
  that passes one of them, not None, decodes (`call_with_cache`,
  `generate`): it runs as keras-hub wrote it. Every other call trains and is
  recomputed (checked for every row: no backbone passes a cache in
  training -- except Gemma3n's KV-shared layers, whose blocks are not listed);
- `core`: what `policy="attention"` recomputes. `KERAS` for blocks whose
  attention layers are Keras `MultiHeadAttention`s with Keras's own core
  (`recompute_grad(policy="attention")` as for any Keras block: blocked
  core, GELU input kept); `(attention class path, core method)` pairs for the
  blocks whose attention layers compute attention in a method of their own
  (that method, called inside a training call, keeps only its inputs and
  runs again in the backward pass, its dropout replayed); `()` where no such
  method exists (the attention is computed inline in a layer's `call`):
  there `policy="attention"` recomputes the block in full and warns once.

Every row is checked on both backends by tests/helpers/keras_hub_decoder_checks.py
(a tiny backbone per class). `docs/keras_hub.md` lists every block class of
keras-hub 0.32: covered here, or why not (Gemma3n, Moonshine, the vision,
audio and diffusion blocks are not listed).
"""

import importlib
import importlib.resources
from typing import NamedTuple

from ..adapters import _mha_private

KERAS = "keras"  # `core` of the blocks built on Keras's `MultiHeadAttention` core
_SRC = "keras_hub.src.models."


class Block(NamedTuple):
    path: str  # "keras_hub.src.<module>.<Class>"
    cache: tuple  # the arguments whose value (not None) means a decoding call
    core: object  # KERAS, ((attention class path, method), ...), or () (unreachable)


# The table itself is data: recompute/keras_hub/blocks.txt (its header says how to read a row).
_TABLE = importlib.resources.files(__package__).joinpath("blocks.txt").read_text(encoding="utf-8")


def _full(path):
    return path if path.startswith("keras_hub.") else _SRC + path


def _parse_core(text):
    if text == KERAS:
        return KERAS
    if text == "-":
        return ()
    cores = []
    for item in text.split():
        path, _, method = item.partition(":")
        cores.append((_full(path), method or _mha_private.CORE))
    return tuple(cores)


BLOCKS = tuple(
    Block(_full(path), () if cache == "-" else tuple(cache.split(",")), _parse_core(core))
    for path, cache, core in (
        line.split(None, 2) for line in _TABLE.splitlines() if line.strip() and not line.startswith("#")
    )
)


def load(path):
    """The class at `path` ("package.module.Class") in the installed keras-hub, or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def installed():
    """(class, its `Block` row) for each row whose class the installed keras-hub has."""
    found = []
    for row in BLOCKS:
        cls = load(row.path)
        if cls is not None:
            found.append((cls, row))
    return found


def cores(row):
    """The (attention class, core method name) pairs of `row` the installed keras-hub has."""
    if row.core == KERAS:
        return ()
    return tuple((cls, method) for cls, method in ((load(p), m) for p, m in row.core)
                 if cls is not None and method in vars(cls))
