"""The only module that touches TensorFlow internals.

TensorFlow has no public API for three things recomputation needs:
- pausing every active `GradientTape` on this thread while the forward pass
  runs (so the tapes do not keep the block's activations alive) -- the same
  call `tf.recompute_grad` makes internally;
- asking whether any tape is recording at all (so that a call outside training
  costs nothing);
- asking whether a forward-mode accumulator (`tf.autodiff.ForwardAccumulator`)
  watches a tensor (recomputation only defines reverse-mode gradients).
"""

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record

stop_recording = record.stop_recording


def tape_is_active():
    """True if a `GradientTape` (or forward accumulator) is active on this thread."""
    return record.could_possibly_record()


def forward_accumulator_watches(tensors):
    """True if an active `tf.autodiff.ForwardAccumulator` watches any of `tensors`."""
    if not tensors:
        return False
    _, tangents = pywrap_tfe.TFE_Py_PackJVPs(list(tensors))
    return bool(tangents)


class ordered_stateful_ops:
    """Orders the stateful ops built inside, as `tf.function` does, where nothing else does.

    A backward pass is usually built inside the `tf.function` that holds the
    tape, whose automatic control dependencies run variable reads and writes in
    program order. The backward function TensorFlow builds for a `tf.function`
    called under an *eager* tape has no such ordering: there, this context adds
    it (TensorFlow's `AutomaticControlDependencies`, the mechanism `tf.function`
    itself uses). Elsewhere it does nothing. `mark(tensor)` returns a tensor that
    is only available once every stateful op of the scope has run.
    """

    def __init__(self):
        from tensorflow.python.framework import auto_control_deps, ops

        graph = ops.get_default_graph()
        needed = not context_executing_eagerly() and not getattr(
            graph, "_add_control_dependencies", False
        )
        self._acd = auto_control_deps.AutomaticControlDependencies() if needed else None

    def __enter__(self):
        if self._acd is not None:
            self._acd.__enter__()
        return self

    def mark(self, tensor):
        if self._acd is None or tensor is None:
            return tensor
        return self._acd.mark_as_return(tensor)

    def __exit__(self, *exc_info):
        if self._acd is not None:
            return self._acd.__exit__(*exc_info)
        return False


def context_executing_eagerly():
    from tensorflow.python.eager import context

    return context.executing_eagerly()
