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

Two variants of the checkpoint keep the same inputs elsewhere or work in parts:
`_offloaded` (`offload=True`: the inputs in pinned host memory) and `_by_samples`
(`samples`: the call run on cuts of its batch in both passes, one cut's working set alive
at a time; `recompute.batch_cut`).

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


def recomputed_call(call, layer, args, kwargs, policy=None, offload=False, samples=None):
    """Runs `call(layer, *args, **kwargs)` under `jax.checkpoint` (with `policy`: what it
    may keep; None keeps nothing but the inputs), state threaded through it. With `offload`
    (policy None only), the inputs are kept in pinned host memory instead (`_offloaded`).
    With `samples` (policy None only), the call runs on cuts of that many samples of its
    batch where the batch is larger (`_by_samples`)."""
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
    if samples is not None:
        if policy is not None:
            raise ValueError("`samples` cuts a call that keeps its inputs only: it takes "
                             f"policy=None. Received: policy={policy!r}")
        run = _by_samples(pure, run, samples, offload, traced)
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




def _by_samples(pure, whole, samples, offload, traced):
    """`pure(values, inputs)` run `samples` samples at a time, in both passes, where its batch
    is larger; else `whole` (the call as one checkpoint).

    A `jax.custom_vjp`. The forward pass runs the call on each cut of the batch in turn (a
    `jax.lax.fori_loop`, `scan_after`, and the rest after it) and keeps only the inputs
    (with `offload`, in pinned host memory); the backward pass runs again on each cut and differentiates it there
    (`jax.vjp`), summing the weights' gradients over the cuts. So a step holds one cut's
    working set of the call at a time, not the batch's. While each cut is traced, the
    `BatchWindow` of `_running` is active: the random draws inside (`Dropout` layers through
    `recompute.policies._jax`, the attention core's bits) draw the whole batch's numbers and
    cut them, so that the values are the uncut call's. The inputs cut are the arrays whose
    leading axis has the batch's length (the batch: the first floating input's leading
    axis); the others pass whole. Runs `whole` instead where the cut call adds a loss,
    assigns a variable other than a seed generator's state, or returns an array that is not
    floating or has not the batch's leading axis (its value would then depend on the
    cut)."""
    import jax
    import jax.numpy as jnp

    def run(values, inputs):
        batch = next((x.shape[0] for x in inputs if x.ndim and _floating(x)), None)
        if batch is None or batch <= samples:
            return whole(values, inputs)
        cut_axis = [bool(x.ndim) and x.shape[0] == batch for x in inputs]
        n, rest = divmod(batch, samples)

        def cut(xs, start, size):
            return [jax.lax.dynamic_slice_in_dim(x, start, size, 0) if c else x
                    for x, c in zip(xs, cut_axis)]

        def windowed(size):
            def call(values, inputs, start):
                with _running.windows.entered(_running.BatchWindow(start, size, batch)):
                    return pure(values, inputs)

            return call

        pieces = []  # (the cut call as a closed function, its constants, samples per cut)
        for size in [samples] + ([rest] if rest else []):
            converted, consts = jax.closure_convert(
                windowed(size), values, cut(inputs, 0, size), jnp.int32(0))
            shapes = jax.eval_shape(converted, values, cut(inputs, 0, size), jnp.int32(0),
                                    *consts)
            if shapes[2] or any(v.name != _keras3.SEED_STATE for v in traced["assigned"]) or any(
                    not o.ndim or o.shape[0] != size or not _floating(o) for o in shapes[0]):
                return whole(values, inputs)
            pieces.append((converted, consts, size))

        def forward_all(values, inputs, consts):
            def body(carry, i):
                start = i * samples
                outputs, state, _ = pieces[0][0](values, cut(inputs, start, samples), start,
                                                 *consts[0])
                return carry, (outputs, state)

            anchor = next(x for x in inputs if _floating(x))
            _, (outputs, states) = scan_after(body, (), n, anchor)
            outputs = [o.reshape((n * samples,) + o.shape[2:]) for o in outputs]
            state = [s[0] for s in states]  # the same at every cut: the draws start alike
            if rest:
                start = n * samples
                last, _, _ = pieces[1][0](values, cut(inputs, start, rest), jnp.int32(start),
                                          *consts[1])
                outputs = [jnp.concatenate([a, b], 0) for a, b in zip(outputs, last)]
            return outputs, state, []

        host, device = jax.memory.Space.Host, jax.memory.Space.Device

        @jax.custom_vjp
        def by_samples(values, inputs, consts):
            return forward_all(values, inputs, consts)

        def forward(values, inputs, consts):
            results = forward_all(values, inputs, consts)
            kept = [jax.device_put(x, host) if offload and _floating(x) else x for x in inputs]
            results, kept = _barrier((results, kept))
            return results, (values, kept, consts)

        def backward(residuals, cotangents):
            values, kept, consts = residuals
            values, kept, consts, cotangents = _barrier((values, kept, consts, cotangents))
            inputs = [jax.device_put(x, device) if offload and _floating(x) else x
                      for x in kept]
            d_outputs, d_state, _ = cotangents
            floats = [i for i, x in enumerate(inputs) if _floating(x)]

            def one_cut(k, start, size):
                """The float gradients of (values, cut float inputs, constants) at one cut."""
                xs = cut(inputs, start, size)
                weights = _float_leaves((values, consts[k]))

                def f(w, fx):
                    v, c = _with_leaves((values, consts[k]), w)
                    full = list(xs)
                    for i, x in zip(floats, fx):
                        full[i] = x
                    return pieces[k][0](v, full, start, *c)

                _, vjp = jax.vjp(f, weights, [xs[i] for i in floats])
                d_outs = [jax.lax.dynamic_slice_in_dim(g, start, size, 0) for g in d_outputs]
                return vjp((d_outs, d_state, []))

            def body(sums, i):
                d_weights, d_floats = one_cut(0, i * samples, samples)
                return [s + g.astype(s.dtype) for s, g in zip(sums, d_weights)], d_floats

            anchor = d_outputs[0]
            zero = [jnp.broadcast_to(zero_after(anchor, _sum_dtype(w)), w.shape)
                    for w in _float_leaves((values, consts[0]))]
            sums, stacked = scan_after(body, zero, n, anchor)
            d_inputs = {i: (g.reshape((n * samples,) + g.shape[2:]) if cut_axis[i]
                            else g.sum(0)) for i, g in zip(floats, stacked)}
            d_values, d_consts = _with_leaves((values, consts[0]), sums, zeros=True)
            d_consts = [d_consts]
            if rest:
                d_weights, d_floats = one_cut(1, jnp.int32(n * samples), rest)
                d_v, d_c = _with_leaves((values, consts[1]), d_weights, zeros=True)
                d_values = jax.tree_util.tree_map(_add, d_values, d_v)
                d_consts.append(d_c)
                for i, g in zip(floats, d_floats):
                    d_inputs[i] = (jnp.concatenate([d_inputs[i], g], 0) if cut_axis[i]
                                   else d_inputs[i] + g)
            d_all = [d_inputs[i] if i in d_inputs else _float0(x)
                     for i, x in enumerate(inputs)]
            return _barrier((_cast_like(d_values, values), d_all,
                             [_cast_like(d, c) for d, c in zip(d_consts, consts)]))

        by_samples.defvjp(forward, backward)
        return by_samples(values, inputs, [p[1] for p in pieces])

    return run


def _float0(x):
    import jax

    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _float_leaves(tree):
    """The floating-point arrays of `tree`, in its order."""
    import jax

    return [x for x in jax.tree_util.tree_leaves(tree) if _floating(x)]


def _with_leaves(tree, floats, zeros=False):
    """`tree` with its floating-point leaves replaced by `floats` (in order), and with
    `zeros`, its other leaves by float0 zeros (their gradients)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    floats = iter(floats)
    leaves = [next(floats) if _floating(x) else (_float0(x) if zeros else x) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _sum_dtype(x):
    """float32 for half-precision gradients summed over cuts, else their own dtype."""
    import jax.numpy as jnp

    return jnp.float32 if jnp.finfo(x.dtype).bits < 32 else x.dtype


def _add(a, b):
    import jax

    return a if a.dtype == jax.dtypes.float0 else a + b.astype(a.dtype)


def _cast_like(grads, like):
    import jax

    def cast(g, x):
        return g if g.dtype == jax.dtypes.float0 else g.astype(x.dtype)

    return jax.tree_util.tree_map(cast, grads, like)


def zero_after(x, dtype):
    """A scalar zero of `dtype` that exists only once `x` does: it passes through an
    optimization barrier with `x`, so XLA can neither fold it into a constant nor make it
    before `x` (see `scan_after`)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.optimization_barrier((x, jnp.zeros((), dtype)))[1]


def scan_after(body, carry, n, anchor):
    """`jax.lax.scan(body, carry, jnp.arange(n))` whose buffers are made after `anchor`.

    `jax.lax.scan` stacks its ys into a buffer of zeros, and the blocked attention core's
    backward pass (`recompute.ops._flash.backward`) starts dK and dV from zeros: values
    that depend on nothing. XLA's GPU pipeline fused those zero buffers of every layer's
    loops into one operation at the start of the step, so all of them were alive at once
    (BERT-base on an H100: 63 MiB per sample more than without the blocked core;
    docs/attention.md, "On JAX"). Here the ys buffer is zeros made after `anchor` (an
    input of the caller: `zero_after`), as the callers make their zero carries, and the
    blocks run in a `jax.lax.fori_loop`, each y written in place. Used by the blocked
    core (`recompute.ops._flash_jax`) and by a call run by samples (`_by_samples`).
    """
    import jax
    import jax.numpy as jnp

    shapes = jax.eval_shape(lambda c: body(c, jnp.asarray(0, jnp.int32))[1], carry)
    ys = jax.tree_util.tree_map(
        lambda y: jnp.broadcast_to(zero_after(anchor, y.dtype), (n,) + tuple(y.shape)), shapes)

    def step(i, state):
        carry, ys = state
        carry, y = body(carry, i)
        return carry, jax.tree_util.tree_map(
            lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0), ys, y)

    return jax.lax.fori_loop(0, n, step, (carry, ys))
