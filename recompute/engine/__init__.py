"""The recomputation engines, behind one interface: `of(adapter)` is the engine that runs a
layer's recomputation, `inside_recomputed_call()` tells either engine's.

An `Engine` (`TensorFlowEngine`, `JaxEngine`) answers these, and nothing else of the
recomputation is asked by what uses it (`recompute._decorator`, the policies, the
integrations):

- `recomputes()`: whether a call made now is recomputed -- on TensorFlow where a tape
  records and no recomputed call encloses it, on JAX where no recomputed call is being
  traced and Keras is not inferring shapes (the outermost decorated call is the unit);
- `recomputed_call(fn, layer, args, kwargs)`: `fn(layer, *args, **kwargs)` recomputed for
  the gradient; `run(policy, fn, layer, args, kwargs)`: a policy's function for this
  engine (`recompute.policies._registry.Policy`), handed what it needs.

The engines: `_core` (TensorFlow: one `tf.custom_gradient` around the call, forward out of
the tapes' reach, backward under a fresh tape in the same call context; `kept` and
`after`) and `_jax` (Keras 3's JAX backend: the call as a `jax.checkpoint`, the layer's
state threaded through; with `offload`, its inputs kept in host memory; with `samples`,
its batch run in cuts, `_by_samples`, of the size `_batch_cut` gives, while `_running`'s
`BatchWindow` tells the random draws inside which samples they draw); `_cuts_tf`
(TensorFlow's recomputation in cuts of the batch, a `_core.Recomputation` whose passes run
cut by cut, for Keras 3 blocks and bert4keras's blocks under `"full"`). Both track their
running calls in one `_running.calls` (the one tracker: `inside_recomputed_call()`).
They ask the Keras family through `recompute.adapters`.

What a TensorFlow recomputation offers the code it runs (the ops, the integrations):
`kept(compute)` (computed once per step, kept through the recomputation: dropout
decisions), `after(tensors, *gates)` (tensors gated on the incoming gradient, so that a
recomputation does not run early: where TensorFlow sees no GPU and XLA does not compile, a
view of each, no copy), `check_recomputable` and `float_tensors` (the check a
call makes before it is recomputed), `recomputing(layer)` and `replaying()` (whether
`layer`'s recomputed call is running, and whether as its recomputation) and
`forward_outputs()` (in the recomputation, the call's outputs from the forward pass, cut
by cut: a gradient taken from an output, `recompute.bert4keras._norm_from_output`).
"""

from ..adapters import _backends, _tf
from .._errors import TENSORFLOW_OFFLOAD
from . import _core, _jax, _running
from ._core import (after, check_recomputable, float_tensors, forward_outputs, kept,  # noqa: F401
                    recomputing, replaying)  # (TensorFlow's)


class Engine:
    """What every engine answers (the module's docstring); built for one layer's family."""

    name = None  # "tensorflow" or "jax"

    def __init__(self, adapter):
        self.adapter = adapter

    def recomputes(self):
        """Whether a call made now is recomputed (else it runs as written)."""
        raise NotImplementedError

    def recomputed_call(self, fn, layer, args, kwargs):
        """`fn(layer, *args, **kwargs)`, recomputed for the gradient."""
        raise NotImplementedError

    def run(self, policy, fn, layer, args, kwargs, offload=False):
        """`policy`'s function for this engine (a `recompute.policies._registry.Policy`); with
        `offload`, the recomputed calls it makes keep their inputs in host memory (JAX only)."""
        raise NotImplementedError


class TensorFlowEngine(Engine):
    """Keras 3 on TensorFlow and tf_keras: `_core`, with the layer's family `adapter`."""

    name = "tensorflow"

    @staticmethod
    def recomputes():
        return _tf.tape_is_active() and not _running.inside_recomputed_call()

    def recomputed_call(self, fn, layer, args, kwargs):
        return _core.recomputed_call(self.adapter, fn, layer, args, kwargs)

    def run(self, policy, fn, layer, args, kwargs, offload=False):
        if offload:
            raise ValueError(TENSORFLOW_OFFLOAD)
        return policy.tensorflow(self.adapter, fn, layer, args, kwargs)


class JaxEngine(Engine):
    """Keras 3 on JAX: `_jax` (its family is always Keras 3's)."""

    name = "jax"

    @staticmethod
    def recomputes():
        return not (_running.inside_recomputed_call() or _jax.in_shape_inference())

    def recomputed_call(self, fn, layer, args, kwargs):
        return _jax.recomputed_call(fn, layer, args, kwargs)

    def run(self, policy, fn, layer, args, kwargs, offload=False):
        return policy.jax(fn, layer, args, kwargs, offload=offload)


def of(adapter):
    """The engine of a layer of `adapter`'s family (`_backends.adapter_for(layer)`)."""
    return JaxEngine(adapter) if _backends.on_jax(adapter) else TensorFlowEngine(adapter)


inside_recomputed_call = _running.inside_recomputed_call  # the one tracker, both engines'
