"""tf_keras (Keras 2, what bert4keras runs on): what a recomputation must capture and restore.

Uses private tf_keras names -- the call context, the autocast dtype of mixed
precision, the layers' `RandomGenerator`s and loss lists -- because tf_keras
has no public API for them; they are all read here and nowhere else (but
`MultiHeadAttention`'s, in `recompute.adapters._mha_private`, and the Keras mask, which
Keras 3 names alike: `recompute.adapters._keras_private`). `PRIVATE_NAMES` lists them as
`(attribute, owners)`, in the format of `recompute.adapters._names` (`accum._inner`'s): an attribute (a dotted
path for an attribute of an attribute) that each owner -- a module, or a class by
its import path (an instance of it where the interface test builds one), or a
description of an object the test makes -- must have;
tests/recompute_tf_keras/test_private_interface_tf_keras.py checks them against the
installed tf_keras (frozen at 2.x), so that a release that renames one fails there,
naming it.

Random numbers. With `tf_keras.backend.experimental.enable_tf_random_generator()`
each layer draws from a `tf.random.Generator` whose state is a variable: it is
replayed exactly like any other state. By default, though, tf_keras uses legacy
stateful random ops, whose hidden kernel state cannot be saved or rewound. Then
each decorated call draws one seed from the legacy generator and, while the
call runs (forward pass, and again in the recomputation), every legacy draw of
a tf_keras `RandomGenerator` in this thread -- including those of `Dropout`
layers created inside `call`, as bert4keras's attention does -- becomes a
stateless function of that seed and of its position in the call: the masks of
both passes are identical (gradients are exact for the forward pass that ran),
but they are not the masks a run without recomputation would have drawn.
With the replayable RNG, a `Dropout` created inside `call` would make a new
generator on every call, the recomputation's included, which nothing can
replay: that raises `VariableCreatedInRecomputationError`, which says to
create the layer once in `__init__`/`build`.

Inside a cut of a batch run by samples (`windowed_draws`: bert4keras's blocks under
`"block"`, `recompute.engine._cuts_tf`), a dropout draws the whole batch's numbers for the
cut's samples, under either RNG: from the replay's seed, or from its generator's state,
which then advances as one draw of the batch advances it (`_tf.generator_key_counter`). So the masks
are those of the whole batch's call, and with the replayable RNG those of RECOMPUTE=0.
"""

import contextlib
import threading

import tensorflow as tf

from . import _mha_private, _tf
from .._scoped import ThreadStack
from ._keras3 import copy_output_mask, output_mask, set_output_mask  # noqa: F401  (tf_keras keeps
# masks in the same attribute)
from ._keras3 import unique
from ._names import owned_by

_LAYER = "tf_keras.layers.Layer"
_RANDOM_GENERATOR = "tf_keras.src.backend.RandomGenerator"
_CALL_CONTEXT = "tf_keras.src.engine.base_layer_utils.CallContext"
_AUTOCAST = "tf_keras.src.mixed_precision.autocast_variable"
GELU = ("tf_keras.src.activations", "gelu")  # (module, name) of the exact GELU (`recompute.ops._gelu`)
DENSE = ("tf_keras.src.layers.core.dense", "Dense")  # (module, name) of `tf_keras.layers.Dense`
# (module, name) of `tf_keras.layers.EinsumDense`
EINSUM_DENSE = ("tf_keras.src.layers.core.einsum_dense", "EinsumDense")
# (module, name) of `tf_keras.layers.LayerNormalization`
LAYER_NORMALIZATION = ("tf_keras.src.layers.normalization.layer_normalization",
                       "LayerNormalization")
DROPOUT = ("tf_keras.src.layers.regularization.dropout", "Dropout")  # (module, name) of `tf_keras.layers.Dropout`
# `tf.random.Algorithm`'s PHILOX and AUTO_SELECT (Philox where TensorFlow's kernels run): a
# `tf.random.Generator` state [counter, counter, key]
_PHILOX_STATES = (1, 3)

PRIVATE_NAMES = (
    owned_by((_LAYER,), "_flatten_layers", "_losses", "_eager_losses", "_callable_losses",
             "_metrics", "_non_trainable_weights")
    + owned_by(("tf_keras.layers.Dropout",), "_random_generator")
    + owned_by(("a tensor a tf_keras.layers.Masking call returns",), "_keras_mask")
    + owned_by(("tf_keras.src.engine.base_layer_utils",), "call_context")
    + owned_by((_CALL_CONTEXT,), "_state", "_in_keras_graph")
    + owned_by((_AUTOCAST,), "_autocast_dtype", "enable_auto_cast_variables")
    + owned_by((_AUTOCAST + ".AutoCastVariable",), "_variable")
    + owned_by(("tf_keras.src.backend",), "is_tf_random_generator_enabled")
    # `_generator` is made by `_maybe_init` (stateful); read with a default
    + owned_by((_RANDOM_GENERATOR,), "_rng_type", "_maybe_init", "_generator",
               "RNG_LEGACY_STATEFUL", "RNG_STATELESS", "RNG_STATEFUL",
               "make_seed_for_stateless_op")
    + owned_by((GELU[0],), GELU[1])
    + owned_by((DENSE[0],), DENSE[1])
    + owned_by((EINSUM_DENSE[0],), EINSUM_DENSE[1])
    + owned_by((LAYER_NORMALIZATION[0],), LAYER_NORMALIZATION[1])
    + owned_by((DROPOUT[0],), DROPOUT[1])
)

name = "tf_keras"
attention_core = _mha_private.CORE


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
    return unique(tf_variable(v) for v in found)


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


def random_states(layer):
    """The states of the `tf.random.Generator`s of `layer`'s `RandomGenerator`s (made
    already), among `state_variables`."""
    return unique(tf_variable(gen._generator.state) for _, gen in _generators(sublayers(layer))
                  if getattr(gen, "_generator", None) is not None)


def replay_state(layer, state, start):
    """`replay_recording` without a record."""
    return replay_recording(layer, state, start, None)


@contextlib.contextmanager
def replay_recording(layer, state, start, assigned):
    """Runs the recomputation on the start values of `state`, then puts back the end values.

    tf_keras has no stateless scope, so the variables are assigned: the values
    the forward pass ended with are read, the start values written, the call
    recomputed (its RNG draws and moving-statistic updates land on the start
    values), and the end values written back. The caller orders these ops (see
    `_tf.ordered_stateful_ops`). `add_loss`/`add_metric` bookkeeping done by the
    recomputation is undone; the block yields a list that holds, once it
    exits, the loss tensors the recomputation added (in call order). With `assigned` (a
    dict), it also gets, on exit, `{id(variable): (variable, value)}` of every variable of
    `state` with the value the call left in it (`recompute.engine._cuts_tf`: whether a cut
    wrote only random states, and what to write once).

    Under `tf.distribute` (replica context, in the backward pass), the state
    read and written is this replica's copy (`_tf.replica_local`): a plain
    `assign` of a `MirroredVariable` with `SUM`/`MEAN` aggregation would
    all-reduce the restored values (with `SUM`, doubling them on 2 replicas).
    Assignments the recomputed call itself makes go through the distributed
    variable, aggregated as in the forward pass.
    """
    local = [_tf.replica_local(v) for v in state]
    end = [v.read_value() for v in local]
    for v, value in zip(local, start):
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
    if assigned is not None:
        assigned.update((id(v), (v, local_v.read_value())) for v, local_v in zip(state, local))
    for v, value in zip(local, end):
        v.assign(value)


_LOSS_LISTS = ("_losses", "_eager_losses")


def _list_sizes(layers, attrs):
    """`(list, its length now)` of each list attribute `attrs` of each of `layers`."""
    sizes = []
    for lyr in layers:
        for attr in attrs:
            lst = lyr.__dict__.get(attr) if attr != "_eager_losses" else lyr._eager_losses
            if isinstance(lst, list):
                sizes.append((lst, len(lst)))
    return sizes


def _save_python_state(layers):
    """Returns a function that undoes `add_loss`/`add_metric` bookkeeping made after this point."""
    saved = _list_sizes(layers, _LOSS_LISTS + ("_callable_losses", "_metrics"))

    def restore():
        for lst, n in saved:
            del lst[n:]

    return restore


def track_losses(layers):
    """Returns a function listing `(list, index)` of the loss tensors added after this point."""
    sizes = _list_sizes(layers, _LOSS_LISTS)

    def added():
        return [
            (lst, i) for lst, n in sizes for i in range(n, len(lst)) if tf.is_tensor(lst[i])
        ]

    return added


def _legacy_rng_in_use(layers):
    """True if random numbers drawn in the call may come from legacy stateful ops.

    That is the case whenever tf_keras's replayable RNG is off (its default):
    a layer may also create its `Dropout` inside `call` (bert4keras's attention
    does), so looking at the existing sublayers is not enough.
    """
    from tf_keras.src import backend

    if not backend.is_tf_random_generator_enabled():
        return True
    return any(gen._rng_type == gen.RNG_LEGACY_STATEFUL for _, gen in _generators(layers))


class _LegacyReplay:
    """The seeds one decorated call hands out to legacy random ops, in draw order."""

    def __init__(self, seed):
        self.seed = seed
        self.draws = 0

    def next_seed(self):
        self.draws += 1
        return tf.random.experimental.stateless_fold_in(self.seed, self.draws)


_replays = ThreadStack()  # the active `_LegacyReplay`s of this thread
_windows = ThreadStack()  # the windows of the cuts of a batch running in this thread
_redirect_lock = threading.Lock()
_redirect_users = 0
_REDIRECTED = ("dropout", "random_uniform", "random_normal", "truncated_normal")
_saved_methods = {}


def _active_replay():
    return _replays.top()


def _draw_legacy_seed():
    """The seed of one decorated call's legacy random draws.

    Outermost call: one int64 pair from the legacy stateful RNG (so it follows
    `tf.random.set_seed` like any random op). Inside another decorated call:
    the next seed of the enclosing replay, so that it is replayed as well.
    """
    outer = _active_replay()
    if outer is not None:
        return outer.next_seed()
    return tf.random.uniform([2], minval=-(2**31), maxval=2**31 - 1, dtype=tf.int64)


def _window_numbers(gen, replay, shape, dtype, window):
    """The uniform numbers `gen` (a `RandomGenerator`) would draw for a whole batch of
    `(window.batch,) + shape[1:]` (`shape`: a list of ints or a 1-D tensor), the window's
    samples only (`_tf.uniform_window`), or None
    where they cannot be told: from the replay's next seed (legacy draws), the generator's
    fixed seed (stateless), or its `tf.random.Generator`'s key and counter (Philox), the
    generator advanced as the whole draw advances it (`_tf.generator_key_counter`)."""
    if gen._rng_type == gen.RNG_LEGACY_STATEFUL and replay is not None:
        seed = replay.next_seed()
    elif gen._rng_type == gen.RNG_STATELESS:
        seed = gen.make_seed_for_stateless_op()
    elif gen._rng_type == gen.RNG_STATEFUL and gen._generator.algorithm in _PHILOX_STATES:
        per_sample, _ = _tf.sample_numbers(shape)
        total = tf.cast(window.batch, tf.int64) * per_sample  # the whole draw's numbers
        key, counter = _tf.generator_key_counter(gen._generator, total)
        return _tf.uniform_window(key, counter, shape, dtype, window,
                                  alg=gen._generator.algorithm)
    else:
        return None
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return _tf.uniform_window(key, counter, shape, dtype, window)


def _window_dropout(gen, replay, window, inputs, rate, noise_shape=None):
    """`gen.dropout(inputs, rate)` inside a cut of the batch, as the whole batch's for the
    cut's samples (`tf.nn.experimental.general_dropout`, `stateless_dropout`'s formula, on
    `_window_numbers`), or None where it cannot be so (a noise shape, an input that is not
    the cut's samples)."""
    inputs = tf.convert_to_tensor(inputs)
    shape = inputs.shape
    if noise_shape is not None or shape.rank in (None, 0) or not window.holds(shape):
        return None
    numbers = _window_numbers(gen, replay, shape.as_list() if shape.is_fully_defined()
                              else tf.shape(inputs), inputs.dtype, window)
    if numbers is None:
        return None
    return tf.nn.experimental.general_dropout(
        inputs, rate, uniform_sampler=lambda shape, dtype: numbers)


def _redirecting(name, original):
    def method(self, *args, **kwargs):
        replay, window = _active_replay(), _windows.top()
        self._maybe_init()
        if window is not None:  # inside a cut: the whole batch's numbers, or counted
            drawn = _window_dropout(self, replay, window, *args, **kwargs) \
                if name == "dropout" else None
            if drawn is not None:
                return drawn
            window.unwindowed += 1
        if replay is None or self._rng_type != self.RNG_LEGACY_STATEFUL:
            return original(self, *args, **kwargs)
        # For this draw only, a stateless generator seeded by the replay.
        object.__setattr__(self, "_rng_type", self.RNG_STATELESS)
        object.__setattr__(self, "make_seed_for_stateless_op", replay.next_seed)
        try:
            return original(self, *args, **kwargs)
        finally:
            object.__setattr__(self, "_rng_type", self.RNG_LEGACY_STATEFUL)
            object.__delattr__(self, "make_seed_for_stateless_op")

    method.__name__ = original.__name__
    method.__doc__ = original.__doc__
    return method


@contextlib.contextmanager
def _redirected():
    """tf_keras's `RandomGenerator` draws redirected (`_redirecting`) while at least one
    thread is inside this context; they act only in threads inside a legacy replay or a
    window."""
    global _redirect_users
    from tf_keras.src.backend import RandomGenerator

    with _redirect_lock:
        if _redirect_users == 0:
            for name in _REDIRECTED:
                _saved_methods[name] = RandomGenerator.__dict__[name]
                setattr(RandomGenerator, name, _redirecting(name, _saved_methods[name]))
        _redirect_users += 1
    try:
        yield
    finally:
        with _redirect_lock:
            _redirect_users -= 1
            if _redirect_users == 0:
                for name in _REDIRECTED:
                    setattr(RandomGenerator, name, _saved_methods.pop(name))


@contextlib.contextmanager
def _replay_legacy_rng(seed):
    """Makes every legacy-RNG draw of tf_keras in this thread a stateless function of `seed`.

    Yields the `_LegacyReplay`, whose `draws` counts the draws redirected.
    The redirect is installed on tf_keras's `RandomGenerator` class while at
    least one decorated call is inside this context (in any thread), acts only
    in threads that are inside it, and is removed when the last one leaves.
    """
    replay = _LegacyReplay(seed)
    with _redirected(), _replays.entered(replay):
        yield replay


@contextlib.contextmanager
def windowed_draws(window):
    """While active (in this thread), inside a cut of a batch run by samples
    (`window`: a `recompute.engine._running.BatchWindow`, or None: nothing changes), each
    draw of a tf_keras `RandomGenerator` is the whole batch's for the cut's samples: a
    dropout of the cut's samples without a noise shape draws `_window_numbers` (legacy draws
    from the enclosing replay's seed); any other draw runs as written and adds one to
    `window.unwindowed` (the cut then runs whole: `recompute.engine._cuts_tf`)."""
    if window is None:
        yield
        return
    with _redirected(), _windows.entered(window):
        yield


class _LegacyRng:
    """tf_keras's legacy stateful draws, replayed from one seed per decorated call (`_adapter.LegacyRng`)."""

    draw_seed = staticmethod(_draw_legacy_seed)
    replay = staticmethod(_replay_legacy_rng)


def legacy_rng(layers):
    return _LegacyRng if _legacy_rng_in_use(layers) else None


def check_decoration(fn):
    pass  # a tf_keras layer has no backend to refuse


def attention_layers(layers):
    from tf_keras.layers import MultiHeadAttention

    return [layer for layer in layers if isinstance(layer, MultiHeadAttention)]


def scores_asked(args, kwargs):
    """Always True: tf_keras's core is not told whether `call` returns the scores,
    so they are an output of the recomputation (their gradient, zero when
    unused, flows through the softmax)."""
    return True
