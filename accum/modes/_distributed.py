"""`mode="buffer"` under a `tf.distribute` strategy: replica-local buffers, one all-reduce per update.

Works with `MirroredStrategy` (one process, several devices) and
`MultiWorkerMirroredStrategy` (several processes, collective ops), for every
family (Keras 3, tf_keras, tf_keras legacy), in graph-mode `model.fit` and in
custom loops (`strategy.run` inside `tf.function`).

Gradients follow the strategy's convention: each replica's loss is scaled so
that the *sum* over replicas is the loss of the global batch (what Keras's
`fit` does, and `tf.nn.compute_average_loss(..., global_batch_size)` in a
custom loop), so the sum over replicas of the local gradients is the gradient
of the global micro-batch.

A micro-step (one `apply_gradients` per replica):

1. Each replica adds its own, unreduced gradients to its own copy of the
   buffers. The buffers (and the count of micro-batches kept) are replica-local
   variables (`synchronization=ON_READ`; `SyncOnReadVariable`s under a
   strategy), written in place with `strategy.extended.update`, so nothing
   crosses replicas. A replica whose gradients are not finite skips its own
   micro-batch.
2. One `merge_call` moves to the cross-replica context, where the window
   counter (a mirrored variable, equal on every replica) decides with a
   `tf.cond` whether the window is full. `merge_call` synchronizes the
   replica threads of one process while the graph is built; it launches no
   collective and costs nothing at run time.
3. Only on the window's last micro-step, inside that `tf.cond`: one
   `batch_reduce_to(SUM, ...)` of all buffers and of the kept count (one
   round of all-reduces, batched), then, in each replica, the inner optimizer
   is applied to `sum / (kept / replicas)` with its own aggregation turned off
   (tf_keras: `skip_gradients_aggregation=True`; legacy:
   `experimental_aggregate_gradients=False`; Keras 3 has no such argument, so
   the inner optimizer's `_all_reduce_sum_gradients` is replaced by the
   identity while the update is traced). Clipping, weight decay, EMA and
   learning-rate schedules therefore see the global mean of the window, as on
   one device. Then the buffers are zeroed.

So the bytes all-reduced per update are those of one gradient (plus one
scalar), k times less than all-reducing each micro-batch; between updates the
replicas do not communicate at all. (`python -m benchmarks.accum_distribute`,
2 workers on loopback, a 1.6M-parameter MLP, k=8: 1 round and 6.0 MiB per
effective batch, against 9 rounds and 54.1 MiB when the gradients are
all-reduced at every micro-step.)

Gradients that arrive already reduced: tf_keras callers say so with
`skip_gradients_aggregation=True` (legacy: `experimental_aggregate_gradients=False`);
each replica then adds `1 / replicas` of them, so the update counts them once.
tf_keras's `LossScaleOptimizer` outside the wrapper (what `compile` builds
under `mixed_float16`) passes that flag after "aggregating" with the
wrapper's own `aggregate_gradients`, which under a strategy leaves them local:
its gradients are accumulated locally like any others.

Why the decision is taken in the cross-replica context: on CPUs (and on GPUs
outside XLA) both strategies implement a replica-context
`ReplicaContext.all_reduce` with `merge_call`, and `merge_call` inside a
`tf.cond` branch built in replica context fails in graph mode ("`merge_call`
called while defining a new graph or a tf.function", keras-team/keras#20582;
`ReplicaContext.all_reduce` inside a replica-context `tf.cond` fails so with
both strategies, checked with TF 2.21: 2 logical CPUs, and 2 worker
processes). The window counter is a mirrored
variable, so the predicate is the same on every replica and worker, and the
collective inside the branch is run by all of them or by none: this was
checked with `MultiWorkerMirroredStrategy` on two processes (collectives
inside a cross-replica `tf.cond` branch, graph mode). This is the pattern of
Keras's `LossScaleOptimizer`.

Exactness: with finite gradients, the update equals one device with the same
global micro-batch (and batch `k * B`) up to float rounding (the sum runs in
another order). A micro-batch that is not finite on some replica is dropped
on that replica only; the mean divides by the (replica, micro-batch) pairs
kept, `kept / replicas`. An inner loss-scale optimizer (Keras 3 or tf_keras)
then lowers its scale once, at the end of the window (on one device it does so
at the micro-step): only runs with overflows differ from one device.

Limits:
- `mode="momentum"` raises `NotImplementedError` under a strategy (its moments
  are mirrored variables it would update from each replica's own gradients at
  every micro-step); use `mode="buffer"`.
- `jit_compile=True` does not work under these strategies on CPUs, for any
  optimizer (TF 2.21): with `MirroredStrategy` XLA rejects a cluster that
  reads variables of another device ("Trying to access resource ... located
  in device CPU:1 from device CPU:0"), with `MultiWorkerMirroredStrategy`
  "Collectives are not yet implemented for CPU devices when compiling with
  XLA"; Keras 3's `fit(jit_compile=True)` fails before. GPUs are untested here.
- Keras 3's `fit` does not run under `MultiWorkerMirroredStrategy` at all
  (Keras 3.15, any optimizer: keras-team/keras#20585; it reduces the first
  batch and the logs eagerly); use a custom loop there. tf_keras's `fit` works.
- A sparse gradient (`tf.IndexedSlices`, embeddings) is added to a dense
  buffer, so the update all-reduces the whole embedding matrix once, where
  the per-micro-step path reduces k sparse slices.
- `flush()` under a strategy is a collective: under
  `MultiWorkerMirroredStrategy` call it on every worker.
- A `LossScaleOptimizer` *outside* the wrapper decides whether a step is
  finite from the first local replica's gradients (Keras's and tf_keras's
  own logic, which assumes reduced gradients); under
  `MultiWorkerMirroredStrategy` an overflow on one worker only would make
  the workers' loss scales differ. Inside the wrapper (tf_keras's
  recommended place) the decision is taken on reduced values.
"""

import contextlib

import tensorflow as tf

from . import _window

_SUM = tf.distribute.ReduceOp.SUM


def current_strategy():
    """The strategy whose scope (or replica context) we are in, or None for the default one."""
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def in_replica_context():
    """True inside `strategy.run` (or `fit`'s train step) of a non-default strategy."""
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


@contextlib.contextmanager
def replica_local_variables(aggregation=tf.VariableAggregation.SUM):
    """Variables created inside are replica-local (`ON_READ`) under a strategy.

    Reading one in the cross-replica context (saving) aggregates the replicas
    with `aggregation`; assigning one there (restoring) gives each replica
    its share. Outside a strategy the variables are plain.
    """
    if current_strategy() is None:
        yield
        return

    def creator(next_creator, **kwargs):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        kwargs["aggregation"] = aggregation
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def local_share(grads_and_vars, still_local=False):
    """Gradients a caller says are already aggregated, as this replica's share of them.

    tf_keras callers pass `skip_gradients_aggregation=True` (legacy:
    `experimental_aggregate_gradients=False`) with gradients they reduced
    themselves: each replica then holds the global sum, and adds `1 / replicas`
    of it, so that the reduction at the update counts it once. The exception is
    tf_keras's `LossScaleOptimizer` outside the wrapper, which "aggregates"
    with the wrapper's own `aggregate_gradients` (a no-op here: see the
    families) before passing the flag: its gradients are still local
    (`still_local`, which the family tells).
    """
    if still_local:
        return list(grads_and_vars)
    share = 1.0 / tf.distribute.get_strategy().num_replicas_in_sync
    return [(_window.scale_gradient(g, share), v) for g, v in grads_and_vars]


class Window:
    """The distributed window over what the family gives (`ops`, an
    `accum.modes._family.Family`): the window's state (`ops.window_state()`, an
    `accum.modes._window.WindowState`), `apply_inner` (called in each replica: the
    inner optimizer on the reduced mean, without aggregating it again, only the
    touched variables changing), `inner_scope` (entered around it), `loss_scale`
    (micro-gradients are divided by it before they are added), `on_skip` (at the end
    of a window that dropped a micro-batch on some replica) and `finish_batch_norm`.
    The step that uses it is `LOCAL_WINDOW`.
    """

    def __init__(self, ops):
        self.ops = ops

    # -------------------------------------------------------- replica context

    def micro_step(self, grads, indices):
        """One micro-step, called in replica context. Returns `micro_steps` after it."""
        grads = list(grads)
        finite = _window.all_finite(grads)
        scale = self.ops.loss_scale()
        if scale is not None:
            grads = [_window.scale_gradient(g, 1.0 / tf.cast(scale, tf.float64)) for g in grads]
        return tf.distribute.get_replica_context().merge_call(
            self._cross_replica_micro_step, args=(grads, finite), kwargs={"indices": indices}
        )

    # --------------------------------------------------- cross-replica context

    def _cross_replica_micro_step(self, distribution, grads, finite, indices):
        def add(buffer, g, ok):
            tf.cond(ok, lambda: _window.add_to(buffer, g), lambda: None)
            return tf.constant(0)

        def mark(flag, ok):
            flag.assign(tf.where(ok, tf.ones((), flag.dtype), flag.read_value()))
            return tf.constant(0)

        state = self.ops.window_state()
        for i, g in zip(indices, grads):
            distribution.extended.update(state.buffers[i], add, args=(g, finite), group=False)
        for i in indices:
            distribution.extended.update(state.touched[i], mark, args=(finite,), group=False)
        distribution.extended.update(
            state.window_count,
            lambda count, ok: count.assign_add(tf.cast(ok, count.dtype)),
            args=(finite,),
            group=False,
        )
        state.window_steps.assign_add(1)
        _window.maybe_end_window(
            self.ops.steps_per_update,
            state.window_steps,
            lambda: self.end_window(distribution, tuple(range(len(state.buffers)))),
        )
        return state.micro_steps.assign_add(1)

    def end_window(self, distribution, indices):
        """The window's update (cross-replica context): one batched all-reduce, then apply.

        `indices`: every variable the wrapper tracks; those no replica touched in
        the window are left alone (their flags are reduced with the buffers)."""
        state = self.ops.window_state()
        buffers = [state.buffers[i] for i in indices]
        flags = [state.touched[i] for i in indices]
        count = state.window_count

        def read_local():
            return [b.read_value() for b in buffers] + [
                tf.stack([tf.cast(f.read_value(), tf.float32) for f in flags]),
                tf.cast(count.read_value(), tf.float32),
            ]

        local = distribution.extended.call_for_each_replica(read_local)
        destinations = [state.variables[i] for i in indices]
        reduced = distribution.extended.batch_reduce_to(
            _SUM, list(zip(local, destinations + destinations[:1] * 2))
        )
        sums, touched, kept = reduced[:-2], reduced[-2], reduced[-1]
        kept_total = distribution.experimental_local_results(kept)[0]
        touched_total = distribution.experimental_local_results(touched)[0]
        mask = [touched_total[i] > 0 for i in range(len(flags))]
        replicas = float(distribution.num_replicas_in_sync)
        steps = tf.cast(state.window_steps, tf.float32)
        tf.cond(kept_total < replicas * steps, lambda: self.ops.on_skip(), lambda: None)

        def apply():
            def replica_apply(sums, kept):
                micro_batches = kept / replicas  # = window_count on one device
                grads = [s / tf.cast(micro_batches, s.dtype) for s in sums]
                scale = self.ops.loss_scale()
                if scale is not None:
                    grads = [g * tf.cast(scale, g.dtype) for g in grads]
                self.ops.apply_inner(grads, indices, mask)

            with self.ops.inner_scope():
                distribution.extended.call_for_each_replica(replica_apply, args=(sums, kept))

        tf.cond(kept_total > 0, apply, lambda: None)
        for buffer in list(state.buffers) + flags:
            distribution.extended.update(
                buffer, lambda b: b.assign(tf.zeros(b.shape, b.dtype)), group=False
            )
        distribution.extended.update(
            count, lambda c: c.assign(tf.zeros((), c.dtype)), group=False
        )
        state.window_steps.assign(0)
        # `accum.BatchNormalization`: its replica-local window sums, summed over
        # the replicas (one batched reduction per window).
        self.ops.finish_batch_norm(reduce=lambda variables: self._summed(distribution, variables))

    @staticmethod
    def _summed(distribution, variables):
        """Replica-local variables summed over the replicas (cross-replica context)."""

        def read_local():
            return [(v if hasattr(v, "read_value") else v.value).read_value() for v in variables]

        local = distribution.extended.call_for_each_replica(read_local)
        reduced = distribution.extended.batch_reduce_to(_SUM, [(t, t) for t in local])
        return [distribution.experimental_local_results(r)[0] for r in reduced]

    def flush(self, distribution, indices):
        """Applies a partial window (cross-replica context; a collective)."""
        with distribution.scope():
            _window.flush(self.ops.window_state().window_steps,
                          lambda: self.end_window(distribution, indices))


class LocalWindow:
    """The step (`accum.modes._modes.step_for`) of `mode="buffer"` in a replica context of a
    strategy: the `Window` over the family's `ops`; `end_window` and `flush` in the
    cross-replica context, `flush` a collective."""

    def micro_step(self, ops, grads, indices):
        return Window(ops).micro_step(grads, indices)

    def end_window(self, ops):
        Window(ops).end_window(ops.strategy, _every_variable(ops))

    def flush(self, ops):
        Window(ops).flush(ops.strategy, _every_variable(ops))


def _every_variable(ops):
    return tuple(range(len(ops.window_state().variables)))


LOCAL_WINDOW = LocalWindow()
