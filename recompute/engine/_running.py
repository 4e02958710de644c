"""The one tracker of recomputed calls, both engines': the calls running (TensorFlow) or
being traced (JAX) in this thread, innermost last.

The outermost recomputed call is the unit of recomputation: a decorated call inside it (a
decorated sublayer, or `super().call(...)` when the parent's `call` is decorated too, as
bert4keras's LayerNormalization over ScaleOffset) runs plainly -- in the forward pass,
where no tape records anyway, and in the recomputation, which would otherwise recompute
it a second time. Each engine enters a `RunningCall` (TensorFlow's carries what its
forward pass keeps: `recompute.engine._core`).

`windows` holds the `BatchWindow` of a JAX call run in cuts of its batch while each cut is
traced (`batch_window()`): the random draws inside it (`recompute.policies._jax`'s
dropouts, the attention core's bits) draw the whole batch's numbers and take the cut's.
"""

from .._scoped import ThreadStack

calls = ThreadStack()  # the `RunningCall` of each recomputed call running, this thread


class RunningCall:
    """A recomputed call of `layer` while it runs (or, on JAX, is traced)."""

    def __init__(self, layer):
        self.layer = layer


def inside_recomputed_call():
    """True if a recomputed call runs (TensorFlow) or is being traced (JAX) in this thread."""
    return bool(calls)


def innermost(kind):
    """The innermost running call if it is a `kind` (a `RunningCall` class), else None."""
    call = calls.top()
    return call if isinstance(call, kind) else None


windows = ThreadStack()  # the `BatchWindow` of a recomputed call run by samples, while traced


class BatchWindow:
    """The samples `[start, start + size)` of a batch of `batch` samples, on which a
    recomputed call runs (traced) when its batch is cut (`recompute.engine._jax`): every
    random draw inside it is the whole batch's draw, cut to these samples. `start` may be
    a traced integer, and where the batch's size is known only when the step runs
    (`recompute.engine._cuts_tf.DynamicCutRecomputation`) so may `size` and `batch`;
    `leading` is then the static leading axis of the batch's tensors (None where unknown),
    else `batch`. `unwindowed` counts the draws inside it that could not be so (tf_keras's:
    `recompute.adapters._tf_keras.windowed_draws`): then the call runs whole."""

    def __init__(self, start, size, batch, leading=None):
        self.start, self.size, self.batch = start, size, batch
        self.leading = batch if isinstance(batch, int) else leading
        self.unwindowed = 0

    def holds(self, shape):
        """Whether a tensor of static `shape` (rank >= 1) is the window's samples: its
        leading axis the window's size (unknown when the size is)."""
        return shape[0] == (self.size if isinstance(self.size, int) else None)


def batch_window():
    """The `BatchWindow` the call being traced runs on, or None (the whole batch)."""
    return windows.top()
