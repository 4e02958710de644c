"""Fixtures of the bert4keras suite: the MiniLM package's zip and one conversion
of it per session (shared by the converter and tokenizer tests)."""

import pytest


@pytest.fixture(scope="session")
def minilm_zip():
    from recompute.bert4keras import converter

    return converter.minilm_zip()


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    from recompute.bert4keras.converter import minilm

    return minilm(tmp_path_factory.mktemp("minilm") / "google")


@pytest.fixture(scope="session")
def reference(minilm_zip):
    from tests.helpers import numpy_bert

    return numpy_bert.NumpyBert.from_hf(minilm_zip)
