"""Fixtures of the bert4keras suite: the MiniLM package's zip and one conversion
of it per session (shared by the converter and tokenizer tests); the tiny BERT's
configuration with dropout on, and tf_keras's replayable RNG (the patch and block-cut
tests)."""

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


@pytest.fixture
def dropout_config_path(tmp_path):
    """The tiny BERT's configuration (`tests.helpers.tiny_bert`) with dropout 0.1 in the
    hidden layers and the attention."""
    from tests.helpers import tiny_bert

    return tiny_bert.write_config(tmp_path, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


@pytest.fixture
def replayable_rng():
    """tf_keras's replayable RNG, the documented route to RECOMPUTE=0-identical dropout."""
    import tensorflow as tf

    tf.keras.backend.experimental.enable_tf_random_generator()
    yield
    tf.keras.backend.experimental.disable_tf_random_generator()
