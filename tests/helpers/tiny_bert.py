"""The tiny BERT configuration of the bert4keras tests (2 layers, hidden 32, 4 heads)."""

import json

CONFIG = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, hidden_act="gelu", hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, max_position_embeddings=64, type_vocab_size=2,
)


def write_config(directory, **changes):
    """Writes `CONFIG` updated with `changes` to `directory/bert_config.json`; returns its path."""
    path = directory / "bert_config.json"
    path.write_text(json.dumps(dict(CONFIG, **changes)))
    return path
