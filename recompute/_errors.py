"""Exceptions raised by `recompute`."""


class VariableCreatedInRecomputationError(RuntimeError):
    """A layer tried to create a variable while its activations were being recomputed.

    Variables must exist before the backward pass: build the layer and every
    sublayer it calls first (call the model once on a sample batch, or call
    `layer.build(input_shape)`), and create sublayers in `__init__` or
    `build`, not inside `call` (a layer created in `call` is new, with new
    variables, on every call -- the recomputation included).
    """

    # AutoGraph re-raises an error from `tf.function` code under its own type
    # only if that type's constructor is `Exception.__init__` (or a builtin
    # error's); otherwise it becomes a `StagingError`.
    __init__ = Exception.__init__


# Names of the variables random-number generators keep their state in:
# `tf.random.Generator` (tf_keras's replayable RNG) and Keras 3's `SeedGenerator`.
RNG_STATE_NAMES = ("StateVar", "seed_generator_state")


def created_in_recomputation(layer_name, what, tf_keras=False):
    """The `VariableCreatedInRecomputationError` for `layer_name` creating `what` (names).

    `tf_keras`: the layer is a tf_keras layer (its legacy RNG is an alternative).
    """
    if any(name in what for name in RNG_STATE_NAMES):
        legacy = (
            " (With tf_keras, its default legacy RNG -- "
            "`tf_keras.backend.experimental.disable_tf_random_generator()` -- also "
            "replays a `Dropout` created in `call`: gradients are exact, but the "
            "masks differ from a run without recomputation.)"
        )
        return VariableCreatedInRecomputationError(
            f"Layer '{layer_name}' created a random-number generator ({what}) while "
            "its activations were being recomputed for the backward pass: a layer "
            "that draws random numbers (a `Dropout`, say) is created inside `call`, "
            "so every call -- the recomputation too -- makes a new generator, whose "
            "draws cannot be replayed. Create that layer once, in `__init__` or "
            "`build` (`self.dropout = Dropout(rate)`), and call it in `call`."
            + (legacy if tf_keras else "")
        )
    return VariableCreatedInRecomputationError(
        f"Layer '{layer_name}' tried to create {what} while its activations were "
        "being recomputed for the backward pass. Variables must exist before the "
        "recomputation: build the layer and every sublayer it calls first (for "
        "example by calling the model once on a sample batch, or with "
        "`layer.build(input_shape)`), and create sublayers in `__init__` or "
        "`build`, not inside `call`."
    )


def offload_refused(policy):
    """The message for `offload=True` under a policy other than "full"."""
    return ("`offload=True` keeps a recomputed call's inputs in host memory: it applies to "
            f'policy="full" only. Received: policy={policy!r}, offload=True')


TENSORFLOW_OFFLOAD = (
    "`offload=True` keeps a recomputed call's inputs in host memory on Keras 3's JAX backend "
    "only; TensorFlow has no host offload (docs/recompute.md, \"Host offload\"). "
    "Use offload=False on TensorFlow."
)
