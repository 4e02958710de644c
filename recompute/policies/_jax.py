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

Uses private names of Keras's JAX backend -- the raw value of a variable, the
symbolic (shape-inference) scope, the global seed generator and the check
that keeps it out of traced code -- here and nowhere else. `recompute.adapters._keras3`
is the TensorFlow backend's adapter; this module replaces `_core` and the
policies' TensorFlow functions for JAX (`full`, `attention`; `_policies.POLICIES`
names both engines').
"""

import contextlib
import threading

import numpy as np

from ..adapters import _keras3, _keras_private

_running = threading.local()  # .depth: recomputed calls running in this thread


def inside_recomputed_call():
    """True while a recomputed call is being traced in this thread: the outermost one is the unit."""
    return getattr(_running, "depth", 0) > 0


@contextlib.contextmanager
def _running_call():
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


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


def recomputed_call(call, layer, args, kwargs, policy=None):
    """Runs `call(layer, *args, **kwargs)` under `jax.checkpoint` (with `policy`: what it
    may keep; None keeps nothing but the inputs), state threaded through it."""
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
            with scope, _running_call(), _global_seed_allowed(not traced_outside):
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

    results, new_state, losses = jax.checkpoint(pure, policy=policy)(values, [flat[i] for i in dynamic])
    for variable, value in zip(traced["assigned"], new_state):
        variable.assign(value)
    if losses:
        layer.add_loss(losses)
    flat_outputs = list(traced["flat"])
    for i, value in zip(traced["arrays"], results):
        flat_outputs[i] = value
    return keras.tree.pack_sequence_as(traced["outputs"], flat_outputs)


# ------------------------------------------------------------------ policies


def full(fn, layer, args, kwargs):
    """The whole call is one `jax.checkpoint`: it keeps its inputs, runs again in the backward
    pass; its attention cores run blocked (`_flash`), in both passes."""
    from ..ops._attention import with_blocked_cores

    layers = _keras3.attention_layers(_keras3.sublayers(layer))
    if layers:
        fn = with_blocked_cores(fn, lambda: _cores_blocked(layers, _keras3.attention_core))
    return recomputed_call(fn, layer, args, kwargs, _keep_policy() if layers else None)


KEEP_ATTENTION_OUTPUT = [False]  # whether "full" keeps the blocked cores' output and lse


def _keep_policy():
    """The `jax.checkpoint` policy of `"full"`: with `KEEP_ATTENTION_OUTPUT`, it keeps the
    blocked cores' output and log-sum-exp (`_flash_jax.OUTPUT_NAME`, `LSE_NAME`), so that
    the recomputation does not run their forward pass again; else None (inputs only)."""
    if not KEEP_ATTENTION_OUTPUT[0]:
        return None
    import jax

    from ..ops import _flash_jax

    return jax.checkpoint_policies.save_only_these_names(_flash_jax.OUTPUT_NAME,
                                                         _flash_jax.LSE_NAME)


def attention(fn, layer, args, kwargs):
    """Only the attention core (`MultiHeadAttention._compute_attention`) of each multi-head
    attention layer in the call keeps less: blocked (`_flash_jax`: it keeps its inputs and
    the dropout's bits), or, where the core is not the standard case, a `jax.checkpoint`
    (its dropout replayed from the seed state); and the exact GELUs of its `Dense`
    sublayers keep only their input (`_gelu.checkpointed`); everything else is kept."""
    from ..ops import _gelu
    from ..ops._attention import attention_layers  # the check and its message, shared

    layers = attention_layers(_keras3, layer)
    with _cores_blocked(layers, _keras3.attention_core, checkpoint_others=True), \
            _gelu.kept_input(_keras3.sublayers(layer), _gelu.checkpointed):
        return fn(layer, *args, **kwargs)


@contextlib.contextmanager
def _cores_blocked(layers, name, checkpoint_others=False):
    """While active, `name` (the attention core) of each layer runs as the blocked core
    where it is the standard case (`_attention.keras_blocked`), else -- with
    `checkpoint_others` -- under `recomputed_call`, else as written. An instance
    attribute shadows the method, removed on exit."""
    from ..ops import _attention, _flash_jax

    installed = []
    try:
        for lyr in layers:
            if name in vars(lyr):  # shadowed already (an enclosing decorated call)
                continue
            method = getattr(type(lyr), name)

            def core(*args, _layer=lyr, _method=method, **kwargs):
                if in_shape_inference():
                    return _method(_layer, *args, **kwargs)
                blocked = _attention.keras_blocked(
                    _flash_jax, _method, _layer, args, kwargs, _keras3.scores_asked(args, kwargs))
                if blocked is not None:
                    return blocked
                if not checkpoint_others or inside_recomputed_call():
                    return _method(_layer, *args, **kwargs)
                return recomputed_call(_method, _layer, args, kwargs)

            object.__setattr__(lyr, name, core)
            installed.append(lyr)
        yield
    finally:
        for lyr in installed:
            object.__delattr__(lyr, name)


def run(policy, fn, layer, args, kwargs):
    """The decorated call on the JAX backend with recomputation on (`recompute_grad`):
    `policy` is this engine's function of the chosen policy (`_policies.POLICIES`)."""
    if inside_recomputed_call() or in_shape_inference():
        return fn(layer, *args, **kwargs)
    return policy(fn, layer, args, kwargs)
