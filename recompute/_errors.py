"""Exceptions raised by `recompute`."""


class VariableCreatedInRecomputationError(RuntimeError):
    """A layer tried to create a variable while its activations were being recomputed.

    Variables must exist before the backward pass: build the layer and every
    sublayer it calls first (call the model once on a sample batch, or call
    `layer.build(input_shape)`).
    """
