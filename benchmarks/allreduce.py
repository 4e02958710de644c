"""`AllReduceCounter`: the cross-replica reductions a `tf.distribute` strategy executes.

A measurement instrument, used by `benchmarks.accum_distribute` (traffic per
effective batch) and by the tests (one all-reduce round per update). It
wraps `CrossDeviceOps.reduce`/`batch_reduce` while `counting()` is active:
private TensorFlow API, kept here, outside the library.
"""

import contextlib

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import values as _values


def _payload_bytes(value):
    """Bytes one replica contributes to the reduction of `value` (a tensor: run time)."""
    if isinstance(value, _values.DistributedValues):
        value = value.values[0]
    if isinstance(value, tf.IndexedSlices):
        return _payload_bytes(value.values) + _payload_bytes(value.indices)
    if isinstance(value, tf.Variable):
        dtype = value.dtype
        size = tf.size(value.read_value(), out_type=tf.int64)
    else:
        value = tf.convert_to_tensor(value)
        dtype = value.dtype
        size = tf.size(value, out_type=tf.int64)
    return size * np.dtype(dtype.as_numpy_dtype).itemsize


def _static_size(value):
    """Elements of one replica's `value` if known while tracing, else a large number."""
    if isinstance(value, _values.DistributedValues):
        value = value.values[0]
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    size = value.shape.num_elements()
    return float("inf") if size is None else size


class AllReduceCounter:
    """Counts the cross-replica reductions a strategy *executes*, and the bytes per replica.

    While `counting()` is active, every call of a `CrossDeviceOps.reduce` or
    `CrossDeviceOps.batch_reduce` (the entry points of every strategy's
    all-reduce: `ReductionToOneDevice` and `AllReduceCrossDeviceOps` for
    `MirroredStrategy`, `CollectiveAllReduce` for `MultiWorkerMirroredStrategy`)
    adds, next to the reduction it builds, ops that increment `rounds` by one
    and `bytes` by the payload of one replica. Inside a `tf.function` these ops
    live in the same graph (and `tf.cond` branch) as the reduction, so the
    counters count executions at run time, not traces. A `batch_reduce` of
    many tensors is one round. Reductions `CrossDeviceOps` short-cuts as local
    (one process, one value) are not counted.

    `functions_only=True` ignores reductions run eagerly (Keras 3's `fit`
    reduces a few scalars and its first batch eagerly, once per call, outside
    the train step). `min_elements=n` ignores rounds whose tensors all have
    fewer than `n` elements: bookkeeping that runs at every step whatever the
    optimizer (tf_keras's `fit` reduces its loss metric's total and count;
    under `MultiWorkerMirroredStrategy` the distributed dataset all-reduces a
    `[1, 1]` tensor per batch to agree on the end of the data).

    Create it outside any strategy scope (its variables are plain). Wrap the
    *tracing* of the functions to count (the first call of a `tf.function`,
    `fit`'s first step); the counters then count every later execution too.
    """

    def __init__(self, functions_only=False, min_elements=0):
        self.functions_only = functions_only
        self.min_elements = min_elements
        with tf.init_scope():
            self.rounds = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_rounds")
            self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_bytes")

    def reset(self):
        self.rounds.assign(0)
        self.bytes.assign(0)

    def _record(self, ops, values):
        if self.functions_only and tf.executing_eagerly():
            return
        # What `CrossDeviceOps` itself short-cuts as local: one process and one value.
        workers = ops._num_between_graph_workers
        values = [v for v in values
                  if workers > 1 or (isinstance(v, _values.DistributedValues) and len(v.values) > 1)]
        if not values:
            return
        if all(_static_size(v) < self.min_elements for v in values):
            return
        self.rounds.assign_add(1)
        self.bytes.assign_add(tf.add_n([_payload_bytes(v) for v in values]))

    @contextlib.contextmanager
    def counting(self):
        base = _cross_device_ops.CrossDeviceOps
        original_reduce, original_batch_reduce = base.reduce, base.batch_reduce
        counter = self

        def reduce(self, reduce_op, per_replica_value, destinations, options=None):
            out = original_reduce(self, reduce_op, per_replica_value, destinations, options)
            counter._record(self, [per_replica_value])
            return out

        def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
            out = original_batch_reduce(self, reduce_op, value_destination_pairs, options)
            counter._record(self, [v for v, _ in value_destination_pairs])
            return out

        base.reduce, base.batch_reduce = reduce, batch_reduce
        try:
            yield self
        finally:
            base.reduce, base.batch_reduce = original_reduce, original_batch_reduce
