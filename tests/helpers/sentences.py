"""Sentences for the converter and tokenizer tests: the shared rt-polarity data
set (../shared/data/rt-polarity, see its README) when present, else built-in ones."""

import os

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


def rt_sentences(per_file):
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
