"""The only module that touches TensorFlow internals.

TensorFlow has no public API for these things recomputation needs:
- pausing every active `GradientTape` on this thread while an eager forward
  pass runs (so the tapes do not keep the block's activations alive) -- the
  same call `tf.recompute_grad` makes internally;
- telling that a `tf.while_loop` body is being built (`in_while_loop_body`), or a body or
  a `tf.cond` branch (`in_control_flow_body`);
- asking whether any tape is recording at all (so that a call outside training
  costs nothing);
- asking whether a forward-mode accumulator (`tf.autodiff.ForwardAccumulator`)
  watches a tensor (recomputation only defines reverse-mode gradients);
- ordering the stateful ops of a backward function (`ordered_stateful_ops`);
- under `tf.distribute`: telling a replica thread of `MirroredStrategy` /
  `MultiWorkerMirroredStrategy` (`strategy.run` calls the replica function in
  threads of its own) from other threads, and reaching the copy of a
  distributed variable that the current replica owns, so that state replayed
  in the backward pass is written to that copy only, with no cross-replica
  aggregation (`replica_local`). Next to it, with public APIs only, what an
  aggregated assignment in replica context leaves in that copy
  (`replica_assigned_value`).
- converting a layer's `call` with AutoGraph the way tf_keras does, and the
  AutoGraph status of the caller (`autograph_convert`, `autograph_status`:
  `tf.__internal__`).

Next to them, with public raw ops only, how TensorFlow's Philox kernels count their
numbers (`philox_advanced`, `uniform_window`): the draws of a cut of the batch, both
Keras families' (`recompute.ops._window_tf`, `recompute.adapters._tf_keras`); and the key
and counter a `tf.random.Generator` draws from (`generator_key_counter`: its private
`_prepare_key_counter`, which advances it and, under `tf.distribute`, mixes the replica
into the key).

`PRIVATE_NAMES` lists each of them as `(attribute, owners)`: an attribute (a dotted
path for an attribute of an attribute) that each owner -- a module, or a class (an
instance of it where the test builds one), by its import path -- must have, in the
format of `accum._inner`'s; tests/recompute_keras3/test_private_interface.py checks
them against the installed TensorFlow, so a TensorFlow upgrade that renames one fails
there, naming it. (`recompute.planner` reads `tensorflow.python.client.device_lib`
itself.)
"""

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record

import contextlib
import threading

import tensorflow as tf

from ._names import owned_by

_DISTRIBUTED_VARIABLE = "tensorflow.python.distribute.values.DistributedVariable"
PRIVATE_NAMES = (
    owned_by(("tensorflow.python.pywrap_tfe",), "TFE_Py_PackJVPs")
    + owned_by(("tensorflow.python.eager.record",), "stop_recording", "could_possibly_record")
    + owned_by(("tensorflow.python.eager.context",), "executing_eagerly")
    + owned_by(("tensorflow.python.framework.ops",), "get_default_graph")
    + owned_by(("tensorflow.python.ops.control_flow_util_v2",), "WhileBodyFuncGraph",
               "CondBranchFuncGraph")
    + owned_by(("tensorflow.python.framework.auto_control_deps",),
               "AutomaticControlDependencies", "AutomaticControlDependencies.mark_as_return")
    # set by `tf.function` on the graphs it builds (read with a default: False)
    + owned_by(("tensorflow.python.framework.func_graph.FuncGraph",), "_add_control_dependencies")
    + owned_by(("tensorflow.python.distribute.mirrored_run",), "_MirroredReplicaThread")
    + owned_by((_DISTRIBUTED_VARIABLE,), "_get_on_device_or_primary")
    + owned_by(("tensorflow",), "__internal__.autograph.tf_convert",
               "__internal__.autograph.control_status_ctx")
    + owned_by(("tensorflow.python.ops.control_flow_util",), "GraphOrParentsInXlaContext")
    + owned_by(("tensorflow.python.client.device_lib",), "list_local_devices")
    + owned_by(("tensorflow.python.ops.stateful_random_ops.Generator",), "_prepare_key_counter")
)

stop_recording = record.stop_recording
# TensorFlow's own functions (not wrappers): AutoGraph, converting a caller, leaves them
# unconverted, as it did `tf.__internal__.autograph.*` called by name.
autograph_convert = tf.__internal__.autograph.tf_convert
autograph_status = tf.__internal__.autograph.control_status_ctx


def sees_a_gpu():
    """Whether TensorFlow sees a GPU in this process (its logical devices)."""
    return bool(tf.config.list_logical_devices("GPU"))


def in_xla_context():
    """Whether the graph being built (or one it is nested in) is compiled by XLA
    (`tf.function(jit_compile=True)`, Keras's `jit_compile=True`)."""
    from tensorflow.python.ops import control_flow_util

    return tf.inside_function() and control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


def pause_outer_tapes():
    """The scope of a recomputed call's forward pass: the tapes already recording keep nothing of it.

    Eager: every tape on this thread is paused (TensorFlow cannot pause some
    tapes and not others, nor list them), so a tape the call opens itself
    would record nothing either (`recomputed_call` refuses such calls). In a graph (`tf.function`, `fit`) nothing is paused:
    the outer tapes record the call's ops symbolically, but the call's outputs
    reach them only through the custom gradient, so the backward graph never
    uses those ops, and a tape opened inside the call (forces as -dE/dx)
    records and differentiates as usual.
    """
    if context_executing_eagerly():
        return stop_recording()
    return contextlib.nullcontext()


def tape_is_active():
    """True if a `GradientTape` (or forward accumulator) is active on this thread."""
    return record.could_possibly_record()


def _building_inside(*kinds):
    """True while a graph of one of the `control_flow_util_v2` classes named by `kinds` is
    being built: the default graph or any graph it is nested in."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util_v2

    classes = tuple(getattr(control_flow_util_v2, kind) for kind in kinds)
    graph = ops.get_default_graph()
    while graph is not None:
        if isinstance(graph, classes):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def in_while_loop_body():
    """True while a `tf.while_loop` body is being built (at any depth of nested graphs).

    Keras runs an RNN cell (`unroll=False`) in such a body inside `tf.function`.
    """
    return _building_inside("WhileBodyFuncGraph")


def in_control_flow_body():
    """True while a `tf.while_loop` body or a `tf.cond` branch is being built (at any depth
    of nested graphs): graphs whose gradient graphs cannot capture a variable that their
    forward pass did not read."""
    return _building_inside("WhileBodyFuncGraph", "CondBranchFuncGraph")


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


def in_replica_thread():
    """True in a thread that `MirroredStrategy`/`MultiWorkerMirroredStrategy` started
    to run a replica (`strategy.run`)."""
    from tensorflow.python.distribute import mirrored_run

    return isinstance(threading.current_thread(), mirrored_run._MirroredReplicaThread)


def _in_replica_of(variable):
    """Whether `variable` is distributed and this thread runs one of its strategy's replicas."""
    return (isinstance(variable, tf.distribute.DistributedValues) and tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context())


def replica_local(variable):
    """In replica context, the component of a distributed `variable` that this replica owns.

    Assigning a `MirroredVariable` in replica context aggregates across the
    replicas (its `SUM`/`MEAN` aggregation: an all-reduce, and with `SUM` a
    restored value would come back multiplied by the number of replicas);
    assigning the component writes this replica's copy only, as an update
    with aggregation `NONE` or a `SyncOnReadVariable` does. Anything else
    (a plain variable, cross-replica context) is returned unchanged.
    """
    if not _in_replica_of(variable):
        return variable
    return variable._get_on_device_or_primary()


def replica_assigned_value(variable, value):
    """What `variable.assign(value)` in replica context leaves in this replica's copy.

    A `MirroredVariable` with aggregation `SUM` or `MEAN` all-reduces the
    values the replicas assign, one with `ONLY_FIRST_REPLICA` takes the first
    replica's (the same collective, so that every replica reads the same
    number); anything else -- aggregation `NONE`, a `SyncOnReadVariable`, a
    plain variable, cross-replica context -- keeps `value`. Used where an
    assignment is recorded instead of executed (a Keras 3 `StatelessScope`).
    """
    if not _in_replica_of(variable):
        return value
    aggregation = variable.aggregation
    if (
        variable.synchronization == tf.VariableSynchronization.ON_READ
        or aggregation == tf.VariableAggregation.NONE
    ):
        return value
    context = tf.distribute.get_replica_context()
    if aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
        first = tf.equal(context.replica_id_in_sync_group, 0)
        return context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.where(first, value, tf.zeros_like(value))
        )
    if aggregation == tf.VariableAggregation.SUM:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)
    return context.all_reduce(tf.distribute.ReduceOp.MEAN, value)


def gpu_memory_limit():
    """The memory TensorFlow's allocator may use on its first GPU, in bytes, or None without
    a GPU (`recompute.planner`'s budget by default): TensorFlow has no public API for it."""
    from tensorflow.python.client import device_lib

    for device in device_lib.list_local_devices():
        if device.device_type == "GPU":
            return int(device.memory_limit)
    return None


# ------------------------------------------- TensorFlow's Philox numbers, counted

def numbers_per_step(dtype):
    """How many numbers of `dtype` one Philox step gives (TensorFlow's `Uniform` kernels)."""
    return 2 if dtype == tf.float64 else 4


def philox_advanced(key, counter, steps):
    """`(key, counter)` of a Philox draw (uint64 [1], uint64 [2]), its counter advanced by
    `steps` (a scalar tensor), the carry into the counter's high word included: the draw
    from there is the first's without its first `steps` steps of numbers."""
    low = counter[0] + tf.cast(steps, tf.uint64)
    return key, tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])


def sample_numbers(shape):
    """`(numbers per sample, numbers)` of a draw of `shape` (a list of ints or a static
    `TensorShape`: Python ints; a 1-D tensor: int64 tensors)."""
    if isinstance(shape, tf.TensorShape):
        shape = shape.as_list()
    if isinstance(shape, (list, tuple)):
        per_sample = 1
        for d in shape[1:]:
            per_sample *= int(d)
        return per_sample, int(shape[0]) * per_sample
    dims = tf.cast(shape, tf.int64)
    per_sample = tf.reduce_prod(dims[1:])
    return per_sample, dims[0] * per_sample


def generator_key_counter(generator, count):
    """`(key, counter)` (uint64 [1], [2]) of `generator`'s next draw of `count` numbers (a
    scalar tensor), as its `uniform` takes them: the generator advanced past that draw, the
    key mixed with the replica's id in a replica context of a distribution strategy."""
    return generator._prepare_key_counter(tf.reshape(count, [1]))


def uniform_window(key, counter, shape, dtype, window, alg=None):
    """The uniform numbers of `dtype` that Philox `(key, counter)` gives a draw of
    `(window.batch,) + shape[1:]`, samples `[window.start, window.start + shape[0])` only,
    drawing only those (`StatelessRandomUniformV2` of `alg`, by default the one
    `tf.random.stateless_uniform` selects: element `i` is the `i % step`-th number
    of the step at `counter + i // step`, `numbers_per_step`; on TensorFlow's kernels and in
    XLA alike). `shape`: the cut's shape, a list of ints (static) or a 1-D tensor;
    `window.start` may be a tensor. `tf.random.stateless_uniform` draws from the seed's
    `StatelessRandomGetKeyCounter`, a `tf.random.Generator` (Philox) from its state
    `[counter, counter, key]`."""
    step = numbers_per_step(dtype)
    per_sample, count = sample_numbers(shape)
    first = tf.cast(window.start, tf.int64) * per_sample
    key, counter = philox_advanced(key, counter, first // step)
    numbers = tf.raw_ops.StatelessRandomUniformV2(
        shape=[count + step - 1], key=key, counter=counter,
        alg=tf.raw_ops.StatelessRandomGetAlg() if alg is None else alg, dtype=dtype)
    return tf.reshape(tf.slice(numbers, [first % step], [count]), shape)
