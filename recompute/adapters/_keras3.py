"""Keras 3 (`keras`, TensorFlow backend): the `_adapter.Adapter` of Keras 3 layers.

On the JAX backend a Keras 3 layer is recomputed by `recompute.engine._jax` instead
(`_backends.on_jax`); other backends are refused here (`check_supported`).

Uses a few private Keras names -- the call context that carries `training` to
sublayers, the autocast scope of mixed precision, the global seed generator and
the per-layer loss lists -- because Keras has no public API for them; they are
all read here and nowhere else.
"""

import contextlib
import sys

from . import _keras_private as _private, _mha_private
from .._errors import created_in_recomputation

name = "Keras 3"
attention_core = _mha_private.CORE


def _keras():
    import keras  # imported lazily: a tf_keras-only process never pays for it

    return keras


SUPPORTED_BACKENDS = ("tensorflow", "jax")


def _check_backend(backend, what):
    """Refuses `what` (a layer running, a method decorated) on a backend other than
    TensorFlow and JAX."""
    if backend in SUPPORTED_BACKENDS:
        return
    raise NotImplementedError(
        "`recompute_grad` supports Keras 3 with the TensorFlow or JAX backend. "
        f"Received: {what} on the {backend!r} backend. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax."
    )


def backend():
    """The Keras 3 backend's name ("tensorflow", "jax", ...)."""
    return _keras().backend.backend()


def check_supported(layer):
    _check_backend(backend(), f"layer '{layer.name}' running")


def check_decoration(fn):
    """At decoration: refuses a Keras 3 program on a backend other than TensorFlow and JAX.

    Only when the layer can only be a Keras 3 one (Keras 3 imported, tf_keras
    not): a tf_keras layer decorated in the same process is still allowed, and
    then refused at its first call if it is a Keras 3 layer after all.
    """
    keras = sys.modules.get("keras")
    if keras is None or "tf_keras" in sys.modules or not hasattr(keras, "backend"):
        return
    backend_fn = getattr(keras.backend, "backend", None)
    if backend_fn is None:  # bert4keras's `keras` (tf_keras under another name)
        return
    _check_backend(backend_fn(), f"`{getattr(fn, '__qualname__', fn)}` decorated")


def sublayers(layer):
    return _private.flatten_layers(layer)


def tf_variable(variable):
    """The `tf.Variable` behind a Keras 3 variable."""
    return _private.backend_value(variable, variable)


def state_variables(layer):
    """Variables a call may change: seeds, moving statistics, metric state.

    Returned as Keras variables, de-duplicated, in a stable order. Includes the
    global seed generator that unseeded `keras.random` calls draw from.

    Chosen by each variable's own `trainable` flag, not by the layer's: a layer
    frozen with `layer.trainable = False` lists every variable as non-trainable,
    LoRA's trainable `lora_kernel_a`/`_b` included (`Backbone.enable_lora`
    freezes every layer, then adds them), and a trainable variable replayed as
    state would be a constant to the recomputation's tape: no gradient. Frozen
    weights (flag off) stay in: reading them costs no copy (a variable's read
    shares its buffer; measured with TensorFlow's allocator, issue 27).
    """
    found = [v for v in layer.variables if not v.trainable] + list(layer.metrics_variables)
    global_gen = _private.global_seed_generator()
    if global_gen is not None:
        found.append(global_gen.state)
    return unique(found)


SEED_STATE = "seed_generator_state"  # the name of a Keras `SeedGenerator`'s state variable


def random_states(layer):
    """The states of the seed generators `layer`'s call draws from (the global one's
    included), among `state_variables`."""
    return [v for v in state_variables(layer) if v.name == SEED_STATE]


def unique(values):
    """`values` (an iterable) without repeats, by identity, in their order."""
    out, seen = [], set()
    for v in values:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def replay_state(layer, state, start):
    """Runs the recomputation on the start values of `state`, discarding its writes
    (`replay_recording` without a record)."""
    return replay_recording(layer, state, start, None)


@contextlib.contextmanager
def replay_recording(layer, state, start, assigned):
    """Runs the recomputation on the start values of `state`, discarding its writes.

    Yields a list that holds, once the block exits, the tensors the
    recomputation passed to `add_loss` (in call order). With `assigned` (a dict), it also
    gets, on exit,
    `{id(variable): (variable, value)}` of each variable the block assigned, with the last
    value assigned (`recompute.engine._cuts_tf` writes a cut's seed states so).

    A `keras.StatelessScope` maps each state variable to the value it had when
    the forward call began: seed generators draw the same seeds again, moving
    statistics read as they were, and every assignment (seed increments,
    BatchNormalization updates, metric updates) and `add_loss` stays inside the
    scope -- nothing is written to the real variables. Under `tf.distribute`
    the start values are this replica's (read in replica context), and an
    assignment to an aggregated variable is combined across replicas as the
    forward pass's was (see `_replay_scope_class`).
    """
    mapping = [(v, value) for v, value in zip(state, start)]
    losses = []
    with creation_refused(layer):
        with _replay_scope_class()(
            mapping, collect_losses=True, initialize_variables=False
        ) as scope:
            yield losses
        losses.extend(scope.losses)
        if assigned is not None:
            assigned.update(scope.assigned)
        for lyr in sublayers(layer):
            _private.clear_loss_ids(lyr)


@contextlib.contextmanager
def creation_refused(layer):
    """Around a call run in a `StatelessScope` that does not initialize variables (a
    recomputation): a variable the call creates -- which Keras then refuses, or defers
    to the scope's exit -- raises `VariableCreatedInRecomputationError` naming `layer`.
    Also used by `recompute.engine._jax`."""
    pending = _private.global_attribute(
        _private.UNINITIALIZED_VARIABLES, [], set_to_default=True
    )
    n_pending = len(pending)
    try:
        yield
    except ValueError as e:
        if "create a variable while in a stateless scope" in str(e):
            raise created_in_recomputation(layer.name, "a variable") from e
        raise
    if len(pending) > n_pending:
        names = [v.path for v in pending[n_pending:]]
        del pending[n_pending:]
        raise created_in_recomputation(layer.name, f"variables {names}")


_REPLAY_SCOPE = []


def _replay_scope_class():
    """`keras.StatelessScope` whose recorded assignments behave like real ones.

    A variable read after an assignment has no gradient path to the assigned
    value (TensorFlow does not differentiate through `assign`), so recorded
    values are cut off the tape: a call that updates a state variable and reads
    it back (say, a running total added from `x`) gets no extra gradient term
    in the recomputation.

    And an aggregated distributed variable gets the value its assignment would
    have given it. Under `tf.distribute`, assigning a `MirroredVariable` whose aggregation is
    `SUM`, `MEAN` or `ONLY_FIRST_REPLICA` in replica context (as the forward
    pass did) combines the values of all replicas; a plain `StatelessScope`
    would record this replica's value alone, and a call that reads the
    variable after updating it would compute something else in the
    recomputation. The combination (an all-reduce) is done when the value is
    read, so an update that is never read back (a metric) costs nothing.
    """
    if not _REPLAY_SCOPE:
        import tensorflow as tf

        from . import _tf

        class ReplayScope(_keras().StatelessScope):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._unaggregated = {}  # id(variable) -> its tf.Variable
                self.assigned = {}  # id(variable) -> (variable, the last value assigned)

            def add_update(self, update):
                variable, value = update
                # A variable read after an assignment has no gradient path to
                # the assigned value; the recorded value must not have one either.
                super().add_update((variable, tf.stop_gradient(value)))
                self._unaggregated[id(variable)] = tf_variable(variable)
                self.assigned[id(variable)] = (variable, self.state_mapping[id(variable)])

            def get_current_value(self, variable):
                target = self._unaggregated.pop(id(variable), None)
                if target is not None:
                    self.state_mapping[id(variable)] = _tf.replica_assigned_value(
                        target, self.state_mapping[id(variable)]
                    )
                return super().get_current_value(variable)

        _REPLAY_SCOPE.append(ReplayScope)
    return _REPLAY_SCOPE[0]


def capture_call_state(layer):
    """Returns a factory of context managers that re-enter the forward call's context.

    The recomputation runs in the backward pass, outside `Layer.__call__`, so the
    call context (which passes `training` down to sublayers) and the mixed
    precision autocast scope that were active in the forward pass are re-entered.
    """
    call_ctx = _private.global_attribute(_private.CURRENT_CALL_CONTEXT)
    autocast = _private.autocast_scope()

    @contextlib.contextmanager
    def reenter():
        previous = _private.global_attribute(_private.CURRENT_CALL_CONTEXT)
        _private.set_global_attribute(_private.CURRENT_CALL_CONTEXT, call_ctx)
        try:
            if autocast is not None:
                with _private.autocast(autocast.dtype):
                    yield
            else:
                yield
        finally:
            _private.set_global_attribute(_private.CURRENT_CALL_CONTEXT, previous)

    return reenter


def copy_output_mask(source, target):
    """Gives `target` the Keras mask attached to `source` (a call output), if any.

    Keras 3 and tf_keras both keep it in `_keras_mask`; `_tf_keras` uses this too.

    A call that sets its outputs' masks itself (a functional model does) would
    otherwise lose them: the tensors `recompute_grad` returns are new ones.
    """
    set_output_mask(target, output_mask(source))


def output_mask(tensor):
    """The Keras mask attached to `tensor`, or None (both families: `_keras_mask`)."""
    return _private.keras_mask(tensor)


def set_output_mask(tensor, mask):
    """Attaches `mask` (unless None) to `tensor` as its Keras mask (both families)."""
    if mask is not None:
        try:
            _private.set_keras_mask(tensor, mask)
        except AttributeError:  # tensors that take no attributes carry no mask
            pass


def track_losses(layers):
    """Returns a function listing `(list, index)` of the losses added after this point."""
    sizes = [(_private.losses(lyr), len(_private.losses(lyr))) for lyr in layers]

    def added():
        return [(lst, i) for lst, n in sizes for i in range(n, len(lst))]

    return added


def legacy_rng(layers):
    return None  # Keras 3 draws every random number from a SeedGenerator, which replays


def attention_layers(layers):
    mha = _keras().layers.MultiHeadAttention
    return [layer for layer in layers if isinstance(layer, mha)]


def scores_asked(args, kwargs):
    """`return_attention_scores`, which `MultiHeadAttention.call` passes its core
    as the sixth argument (query, key, value, attention_mask, training, ...)."""
    asked = args[5] if len(args) > 5 else kwargs.get("return_attention_scores", False)
    return bool(asked)
