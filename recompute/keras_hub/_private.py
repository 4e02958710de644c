"""The private Keras names `chunked_loss` relies on, read here and nowhere else.

Keras 3 has no public API for a model's compiled metrics container, its compile
arguments, how `compute_loss` adds the layers' own losses, or the layer that made
a symbolic tensor; `PRIVATE_NAMES` lists them (attribute, where it lives), and
tests/recompute_keras3/test_keras_hub_chunked_loss.py checks them on the installed
Keras, so that a Keras release that renames one fails there first.
"""

PRIVATE_NAMES = (
    ("_compile_metrics", "a compiled keras.Model (keras.src.trainers.trainer.Trainer)"),
    ("_compile_config", "a compiled keras.Model (keras.src.trainers.trainer.Trainer)"),
    ("_aggregate_additional_loss", "keras.Model (keras.src.trainers.trainer.Trainer)"),
    ("_keras_history", "keras.KerasTensor"),
    ("_inbound_nodes", "keras.Operation"),
)
# Private modules' names: (name, module).
PRIVATE_MODULE_NAMES = (
    ("Functional", "keras.src.models.functional"),
)


def compile_metrics(model):
    """The `CompileMetrics` of a compiled model (its `metrics` and `weighted_metrics`), or None."""
    return getattr(model, "_compile_metrics", None)


def compile_arguments(model):
    """The arguments of the model's last `compile` (`loss`, `metrics`, `loss_weights`,
    `weighted_metrics`, ...) as a dict, or {}."""
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if config is not None else {}


def additional_loss(model, loss):
    """A layer's own loss (`add_loss`, a regularizer) as `compute_loss` adds it."""
    return model._aggregate_additional_loss(loss)


def made_by(tensor):
    """`(layer, node)`: the layer whose call made the symbolic `tensor`, and that call."""
    operation, node_index, _ = tensor._keras_history
    return operation, operation._inbound_nodes[node_index]


def functional_call():
    """`call` of Keras's functional models (the class a `keras.Model(inputs, outputs)` is)."""
    from keras.src.models.functional import Functional

    return Functional.call
