"""tf_keras reference runs for the accum tests: the same inner optimizer at batch k*b
(the family-free part, tests.helpers.accum_runs, imported here too)."""

import numpy as np
import tensorflow as tf
import tf_keras as K

from tests.helpers.accum_runs import (  # noqa: F401 (the reference runs of this family)
    FEATURES, TOKENS, VOCAB, concat, fresh, make_data, make_step, optimizer_variables, run, run_batches, state,
)


def make_model(dtype="float32", seed=0, batch_norm=False, embedding=True):
    """A small model with an embedding (IndexedSlices gradients) and dense layers."""
    K.utils.set_random_seed(seed)
    x = K.Input((FEATURES,), dtype=dtype)
    ids = K.Input((TOKENS,), dtype="int32")
    if embedding:
        e = K.layers.Flatten(dtype=dtype)(K.layers.Embedding(VOCAB, 4, dtype=dtype)(ids))
    else:
        e = K.layers.Lambda(lambda t: tf.cast(t, dtype) / VOCAB, dtype=dtype)(ids)
    h = K.layers.Concatenate(dtype=dtype)([x, e])
    h = K.layers.Dense(8, activation="tanh", dtype=dtype)(h)
    if batch_norm:
        h = K.layers.BatchNormalization(dtype=dtype)(h)
    return K.Model([x, ids], K.layers.Dense(1, dtype=dtype)(h))


def make_dense_model(seed=0):
    """The model without its embedding (no sparse gradients)."""
    return make_model(seed=seed, embedding=False)


def twin(model):
    other = K.models.clone_model(model)
    other.set_weights(model.get_weights())
    return other


def state_by_variable(model, optimizer):
    """Like `state`, but optimizer state listed per model variable and slot name, so the
    order does not depend on creation order (legacy optimizers restored from a
    checkpoint create their slots in restore order)."""
    out = [np.array(w) for w in model.get_weights()]
    opts = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        opts.append(inner)
        out += [np.array(int(optimizer.micro_steps)), np.array(int(optimizer.window_steps)),
                np.array(int(optimizer.window_count))]
    for opt in opts:
        out.append(np.array(int(opt.iterations)))
        for var in model.trainable_variables:
            for slot in opt.get_slot_names():
                out.append(opt.get_slot(var, slot).numpy())
    return out
