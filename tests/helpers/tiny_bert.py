"""The tiny BERT configuration of the bert4keras tests (2 layers, hidden 32, 4 heads), a
classifier built from it, and its loss and gradients (`loss_and_gradients`)."""

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


def classifier(config_path):
    """bert4keras's BERT of `config_path` with a 2-way head on its first token, its weights
    from seed 0 (tf_keras; bert4keras imported here, when called: `test_bert4keras_patch.py`
    checks at its collection that no module imported it before `patch()`)."""
    import tensorflow as tf
    from bert4keras.models import build_transformer_model

    tf.keras.utils.set_random_seed(0)
    bert = build_transformer_model(str(config_path))
    out = tf.keras.layers.Dense(2)(tf.keras.layers.Lambda(lambda x: x[:, 0])(bert.output))
    return tf.keras.Model(bert.inputs, out)


def loss_and_gradients(model, labels):
    """`step(token_ids, segment_ids)`: `model`'s (a `classifier`) mean cross-entropy on
    `labels` in training mode and its gradients for every trainable weight, as a list
    (the loss first): a training step without the update, to run eagerly or traced."""
    import tensorflow as tf

    def step(token_ids, segment_ids):
        with tf.GradientTape() as tape:
            logits = model([token_ids, segment_ids], training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True))
        return [loss] + tape.gradient(loss, model.trainable_weights)

    return step
