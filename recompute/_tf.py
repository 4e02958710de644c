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
