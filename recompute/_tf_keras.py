"""tf_keras (Keras 2, what bert4keras runs on): what a recomputation must capture and restore.

Uses private tf_keras names -- the call context, the autocast dtype of mixed
precision, the layers' `RandomGenerator`s and loss lists -- because tf_keras
has no public API for them; they are all read here and nowhere else.

Random numbers. With `tf_keras.backend.experimental.enable_tf_random_generator()`
each layer draws from a `tf.random.Generator` whose state is a variable: it is
replayed exactly like any other state. By default, though, tf_keras uses legacy
stateful random ops, whose hidden kernel state cannot be saved or rewound. For
those layers, each decorated call draws one seed from the legacy generator and
makes the layers' random ops stateless functions of it, in the forward pass and
again in the recomputation: the masks of both passes are identical (gradients
are exact for the forward pass that ran), but they are not the masks a run
without recomputation would have drawn.
"""

import contextlib

import tensorflow as tf

name = "tf_keras"


def check_supported(layer):
    pass  # tf_keras always runs on TensorFlow


def sublayers(layer):
    return list(layer._flatten_layers(include_self=True, recursive=True))


def _generators(layers):
    for lyr in layers:
        gen = lyr.__dict__.get("_random_generator")
        if gen is not None and hasattr(gen, "_rng_type"):
            yield lyr, gen


def tf_variable(variable):
    """The `tf.Variable` behind a tf_keras weight (unwrapping `AutoCastVariable`)."""
    return getattr(variable, "_variable", variable)


def state_variables(layer):
    """Variables a call may change: RNG states, moving statistics, metric state."""
    layers = sublayers(layer)
    # Weights created non-trainable (moving statistics), not weights merely
    # frozen by `trainable=False`: those never change, and rewriting them in
    # the backward pass would copy them for nothing.
    found = [w for lyr in layers for w in lyr.__dict__.get("_non_trainable_weights", ())]
    for lyr in layers:
        for metric in lyr.__dict__.get("_metrics", ()):
            found.extend(metric.variables)
    for _, gen in _generators(layers):
        tf_gen = getattr(gen, "_generator", None)
        if tf_gen is not None:
            found.append(tf_gen.state)
    out, seen = [], set()
    for v in found:
        v = tf_variable(v)
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def capture_call_state(layer):
    """Returns a factory of context managers that re-enter the forward call's context."""
    from tf_keras.src.engine import base_layer_utils
    from tf_keras.src.mixed_precision import autocast_variable

    call_ctx = base_layer_utils.call_context()
    state = call_ctx._state
    in_keras_graph = call_ctx._in_keras_graph
    dtype = getattr(autocast_variable._autocast_dtype, "dtype", None)

    @contextlib.contextmanager
    def reenter():
        prev_in_call, prev_state = call_ctx.in_call, call_ctx._state
        prev_in_keras_graph = call_ctx._in_keras_graph
        call_ctx.in_call, call_ctx._state = True, state
        call_ctx._in_keras_graph = in_keras_graph
        try:
            with autocast_variable.enable_auto_cast_variables(dtype):
                yield
        finally:
            call_ctx.in_call, call_ctx._state = prev_in_call, prev_state
            call_ctx._in_keras_graph = prev_in_keras_graph

    return reenter


@contextlib.contextmanager
def replay_state(layer, state, start):
    """Runs the recomputation on the start values of `state`, then puts back the end values.

    tf_keras has no stateless scope, so the variables are assigned: the values
    the forward pass ended with are read, the start values written, the call
    recomputed (its RNG draws and moving-statistic updates land on the start
    values), and the end values written back. The caller orders these ops (see
    `_tf.ordered_stateful_ops`). `add_loss`/`add_metric` bookkeeping done by the
    recomputation is undone; the block yields a list that holds, once it
    exits, the loss tensors the recomputation added (in call order).
    """
    end = [v.read_value() for v in state]
    for v, value in zip(state, start):
        v.assign(value)
    layers = sublayers(layer)
    restore_python = _save_python_state(layers)
    added = track_losses(layers)
    losses = []
    try:
        yield losses
        losses.extend(lst[i] for lst, i in added())
    finally:
        restore_python()
    for v, value in zip(state, end):
        v.assign(value)


_LOSS_LISTS = ("_losses", "_eager_losses")


def _save_python_state(layers):
    """Returns a function that undoes `add_loss`/`add_metric` bookkeeping made after this point."""
    saved = []
    for lyr in layers:
        for attr in _LOSS_LISTS + ("_callable_losses", "_metrics"):
            lst = lyr.__dict__.get(attr) if attr != "_eager_losses" else lyr._eager_losses
            if isinstance(lst, list):
                saved.append((lst, len(lst)))

    def restore():
        for lst, n in saved:
            del lst[n:]

    return restore


def track_losses(layers):
    """Returns a function listing `(list, index)` of the loss tensors added after this point."""
    sizes = []
    for lyr in layers:
        for attr in _LOSS_LISTS:
            lst = lyr.__dict__.get(attr) if attr != "_eager_losses" else lyr._eager_losses
            if isinstance(lst, list):
                sizes.append((lst, len(lst)))

    def added():
        return [
            (lst, i) for lst, n in sizes for i in range(n, len(lst)) if tf.is_tensor(lst[i])
        ]

    return added


def legacy_random_generators(layers):
    """The `RandomGenerator`s among `layers` that use legacy stateful ops."""
    out = []
    for lyr, gen in _generators(layers):
        if gen._rng_type == gen.RNG_LEGACY_STATEFUL:
            out.append((lyr, gen))
    return out


def draw_legacy_seed(generators):
    """One int64 seed pair from the legacy stateful RNG (advances it like a random op)."""
    _, gen = generators[0]
    return tf.random.uniform(
        [2], minval=-(2**31), maxval=2**31 - 1, dtype=tf.int64,
        seed=gen.make_legacy_seed(),
    )


@contextlib.contextmanager
def replay_legacy_rng(generators, seed):
    """Makes the layers' legacy generators stateless functions of `seed` for a call."""
    from tf_keras.src.backend import RandomGenerator

    class _Replay(RandomGenerator):
        def __init__(self, index):
            super().__init__(seed=None, rng_type=RandomGenerator.RNG_STATELESS)
            self._built = True
            self._base = tf.random.experimental.stateless_fold_in(seed, index)
            self._draws = 0

        def make_seed_for_stateless_op(self):
            self._draws += 1
            return tf.random.experimental.stateless_fold_in(self._base, self._draws)

    originals = [(lyr, lyr.__dict__["_random_generator"]) for lyr, _ in generators]
    try:
        for index, (lyr, _) in enumerate(originals):
            object.__setattr__(lyr, "_random_generator", _Replay(index))
        yield
    finally:
        for lyr, gen in originals:
            object.__setattr__(lyr, "_random_generator", gen)
