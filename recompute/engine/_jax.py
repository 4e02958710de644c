"""Recomputation on Keras 3's JAX backend: `jax.checkpoint` with the layer's state threaded through.

`jax.checkpoint` (remat) keeps a function's inputs and recomputes the rest in
the backward pass. A Keras layer is not a pure function: it reads variables
(weights, seed generators, BatchNorm moving statistics) and assigns some of
them (a dropout layer's seed advances, BatchNorm updates its statistics).
Handed to `jax.checkpoint` as is, such a layer lets a tracer escape (Keras's
own `keras.remat` fails so with seeded dropout: `UnexpectedTracerError`).
Here the call becomes pure before it is checkpointed:

- every variable of the layer is an explicit input: a `keras.StatelessScope`
  inside the checkpointed function maps each variable to that input (and any
  other variable to the value the enclosing scope -- Keras's JAX trainer,
  `stateless_call` -- gives it);
- every assignment the call makes stays in that scope and comes back as an
  explicit output, with the losses passed to `add_loss`; outside the
  checkpoint, each is assigned (or added) once, to the real variable or to
  the enclosing scope;
- Python values (`training=True`, `mask=None`, strings) are static: only
  arrays go through `jax.checkpoint`.

So the recomputation starts from the same seed state and draws the same
dropout masks, and a state update happens once, in the forward pass. The
call's context (training flag, mixed-precision autocast) is the forward
pass's: JAX traces the call once and replays its jaxpr.

Reads Keras's JAX backend's private names -- the raw value of a variable, the
symbolic (shape-inference) scope, the global seed generator and the check that keeps
it out of traced code -- through `recompute.adapters._keras_private`. This module is
the JAX engine (`_core` is TensorFlow's); the policies' JAX functions that run on it
are `recompute.policies._jax`.
"""

import contextlib
import numpy as np

from ..adapters import _keras3, _keras_private
from . import _running


def in_shape_inference():
    """True while Keras infers output shapes (`compute_output_spec`, a symbolic build):
    nothing is differentiated there, and the call may still create its sublayers' variables."""
    return _keras_private.in_symbolic_scope()


def _scope_class():
    if not _SCOPE:
        import keras

        class RecordingScope(keras.StatelessScope):
            """A `StatelessScope` that also records which variables were assigned, in order."""

            def __init__(self, mapping):
                super().__init__(collect_losses=True, initialize_variables=False)
                self.state_mapping = mapping  # {id(variable): value}
                self.assigned = {}  # id -> variable, first assignment first

            def add_update(self, update):
                variable, value = update
                super().add_update(update)
                self.assigned.setdefault(id(variable), variable)

        _SCOPE.append(RecordingScope)
    return _SCOPE[0]


_SCOPE = []


def _raw_value(variable, outer):
    """The value a variable has now: in the enclosing stateless scope if it maps it, else its own
    (never autocast: the recomputation re-enters the call's autocast scope itself)."""
    if outer is not None:
        value = outer.get_current_value(variable)
        if value is not None:
            return value
    return _keras_private.backend_value(variable)


def _create_global_seed_generator():
    """Creates Keras's global seed generator (unseeded `keras.random` calls) if it does not
    exist yet, so that its state is an input of the checkpoint, not created inside it."""
    _keras_private.create_global_seed_generator()


@contextlib.contextmanager
def _global_seed_allowed(allowed):
    """While tracing the checkpointed call: lets unseeded random ops draw from the global
    seed generator if the caller is not traced itself (eager JAX). Keras refuses them in
    traced code because a traced draw would be frozen into the trace; here its state is an
    explicit input and output of the checkpoint, traced anew at every call."""
    if not allowed:
        yield
        return
    with _keras_private.global_seed_draws_untraced():
        yield


def _is_array(value):
    import jax

    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def recomputed_call(call, layer, args, kwargs, policy=None, offload=False):
    """Runs `call(layer, *args, **kwargs)` under `jax.checkpoint` (with `policy`: what it
    may keep; None keeps nothing but the inputs), state threaded through it. With `offload`
    (policy None only), the inputs are kept in pinned host memory instead (`_offloaded`)."""
    import jax
    import keras
    outer = _keras_private.stateless_scope()
    traced_outside = _keras_private.in_jax_tracing_scope()
    if not traced_outside:
        _create_global_seed_generator()
    variables = list(layer.trainable_variables) + _keras3.state_variables(layer)
    values = [_raw_value(v, outer) for v in variables]
    base = dict(outer.state_mapping) if outer is not None else {}

    structure = (args, kwargs)
    flat = keras.tree.flatten(structure)
    dynamic = [i for i, v in enumerate(flat) if _is_array(v)]
    traced = {}  # what the trace found: output structure, assigned variables

    def pure(variable_values, inputs):
        mapping = dict(base)
        mapping.update({id(v): value for v, value in zip(variables, variable_values)})
        new_flat = list(flat)
        for i, value in zip(dynamic, inputs):
            new_flat[i] = value
        call_args, call_kwargs = keras.tree.pack_sequence_as(structure, new_flat)
        scope = _scope_class()(mapping)
        with _keras3.creation_refused(layer):
            with scope, _running.calls.entered(_running.RunningCall(layer)), \
                    _global_seed_allowed(not traced_outside):
                outputs = call(layer, *call_args, **call_kwargs)
        flat_outputs = keras.tree.flatten(outputs)
        arrays = [i for i, out in enumerate(flat_outputs) if _is_array(out)]
        assigned = list(scope.assigned.values())
        traced.update(outputs=outputs, flat=flat_outputs, arrays=arrays, assigned=assigned)
        return (
            [flat_outputs[i] for i in arrays],
            [scope.state_mapping[id(v)] for v in assigned],
            list(scope.losses),
        )

    if offload and policy is not None:
        raise ValueError("`offload=True` keeps a call's inputs only: it takes policy=None. "
                         f"Received: policy={policy!r}")
    run = _offloaded(pure) if offload else jax.checkpoint(pure, policy=policy)
    results, new_state, losses = run(values, [flat[i] for i in dynamic])
    for variable, value in zip(traced["assigned"], new_state):
        variable.assign(value)
    if losses:
        layer.add_loss(losses)
    flat_outputs = list(traced["flat"])
    for i, value in zip(traced["arrays"], results):
        flat_outputs[i] = value
    return keras.tree.pack_sequence_as(traced["outputs"], flat_outputs)


def _floating(value):
    import jax.numpy as jnp

    return jnp.issubdtype(value.dtype, jnp.inexact)


def _barrier(tree):
    """`lax.optimization_barrier` over the arrays of `tree` that have a dtype XLA knows (not
    float0, the cotangent of an integer input): XLA schedules none of them before all exist."""
    import jax
    from jax import lax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    real = [i for i, v in enumerate(leaves) if v.dtype != jax.dtypes.float0]
    held = lax.optimization_barrier([leaves[i] for i in real])
    for i, value in zip(real, held):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _offloaded(pure):
    """`pure(values, inputs)` that keeps its floating-point `inputs` in pinned host memory for
    the backward pass, instead of `jax.checkpoint`'s device copies, and recomputes from them.

    A `jax.custom_vjp`: the forward pass runs the call and copies its inputs to the host
    (`jax.device_put` to `jax.memory.Space.Host`); the backward pass copies them back and
    differentiates the call (`jax.vjp`), exactly. The call is traced once, here, into a
    jaxpr (`jax.closure_convert`, which makes the differentiated values it closes over
    explicit inputs), so that the backward pass replays the forward pass's trace in its
    context. Three optimization barriers make XLA schedule the transfers where they save
    memory (benchmarks/offload_probe.py): the host copy completes with the call's outputs
    (else XLA starts it in the backward pass, the device copy kept through the forward);
    the copy back and the recomputation wait for the call's incoming gradient, every input
    of the recomputation through the barrier (as `jax.checkpoint`'s `prevent_cse`: else XLA
    shares with the forward pass what depends on the weights and seeds only -- dropout
    masks -- and keeps it from the forward pass); and the call's gradients, the
    weights' with the input's, are complete before the next call's backward pass uses them
    (else XLA defers every weight gradient to the end, each keeping its operands).
    """
    import jax

    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def run(values, inputs):
        converted, consts = jax.closure_convert(pure, values, inputs)

        @jax.custom_vjp
        def offloaded(values, inputs, consts):
            return converted(values, inputs, *consts)

        def forward(values, inputs, consts):
            outputs = converted(values, inputs, *consts)
            kept = [jax.device_put(x, host) if _floating(x) else x for x in inputs]
            outputs, kept = _barrier((outputs, kept))
            return outputs, (values, kept, consts)

        def backward(residuals, cotangents):
            values, kept, consts = residuals
            values, kept, consts, cotangents = _barrier((values, kept, consts, cotangents))
            inputs = [jax.device_put(x, device) if _floating(x) else x for x in kept]
            _, vjp = jax.vjp(lambda v, i, c: converted(v, i, *c), values, inputs, consts)
            return _barrier(vjp(cotangents))

        offloaded.defvjp(forward, backward)
        return offloaded(values, inputs, consts)

    return run
