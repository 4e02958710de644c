"""TensorFlow's recomputation of a call in cuts of its batch (Keras 3 blocks, bert4keras's
blocks on tf_keras; `recompute.batch_cut`).

`recomputed_call(adapter, call, layer, args, kwargs, samples)` is `_core`'s recomputed call,
run `samples` samples at a time in both passes where the batch (the first floating input's
leading axis) is larger: `CutRecomputation` where its shape is known when traced,
`DynamicCutRecomputation` where the batch or the cut is counted only when the step runs
(tf_keras's `fit` traces with an unknown batch; not under XLA, where the call runs whole):

- forward pass, off the tapes: the call on each cut of the batch in turn -- the first cut,
  then a `tf.while_loop` over the other whole cuts (one iteration at a time), then the rest
  -- its outputs joined; it keeps the inputs only, as `_core` does. Each cut runs from the
  state the call started from (the adapter's `replay_recording`), and the random states
  the first cut assigned are then written once, as one call writes them;
- backward pass: the call again on each cut under a tape, from the same state, after the
  incoming gradient; the gradients of the cut inputs joined, those of the weights and of
  the inputs passed whole summed (in float32 where they are half precision).

So a step holds one cut's working set of the call at a time, not the batch's. While a cut
runs, a `_running.BatchWindow` is active: the dropouts inside draw the whole batch's random
numbers for the cut's samples (`recompute.ops._window_tf.windowed_draws`, which the policy
puts in the call: Keras 3's dropouts, tf_keras's draws, whose random generators advance as
one draw of the batch advances them; the blocked attention core's bits,
`recompute.ops._flash_tf.dropout_bits`). What a cut's forward pass keeps for its
recomputation (`_core.kept`: the decision of an attention dropout, as bits) is kept by cut -- a `tf.TensorArray` over the whole cuts,
written by the forward loop and read by the backward one -- and replayed there; what is kept
with `in_cuts=False` (the FlashAttention-2 core's bits) is drawn again in each pass. The
tensors cut are those whose leading axis is the batch's (`BatchWindow.leading`: its length,
or unknown with it), and the gradients of the outputs; the outputs' Keras masks are joined
like the outputs. Where the first cut adds a loss, assigns a variable other than
a random state (the adapter's `random_states`), makes a random draw that is not the batch's
for its samples (`BatchWindow.unwindowed`), or returns something that is not a floating
tensor with the cut's leading axis (or a mask without it), the call runs whole instead
(`_core`'s `Recomputation`), as its value would depend on the cut.
"""

import tensorflow as tf

from ..adapters import _tf
from . import _core, _running

HALF = (tf.float16, tf.bfloat16)


def recomputed_call(adapter, call, layer, args, kwargs, samples=None):
    """`call(layer, *args, **kwargs)` recomputed for the gradient (`_core.recomputed_call`),
    run `samples` samples at a time where its batch is larger (the module's docstring).
    `samples` may be a scalar tensor; where it is, or the first floating input's shape is
    not all known when traced, the cuts are counted when the step runs
    (`DynamicCutRecomputation`) -- except where XLA compiles the step: the call then runs
    whole."""
    first = next(iter(_core.float_tensors((args, kwargs))), None)
    if samples is None or first is None or not first.shape.rank:
        return _core.recomputed_call(adapter, call, layer, args, kwargs)
    batch = first.shape[0]
    if batch is None or tf.is_tensor(samples) or not first.shape[1:].is_fully_defined():
        if _tf.in_xla_context():  # XLA takes no cut of a size known only when it runs
            return _core.recomputed_call(adapter, call, layer, args, kwargs)
        return DynamicCutRecomputation(adapter, call, layer, args, kwargs, first,
                                       samples).run()
    if batch <= samples:
        return _core.recomputed_call(adapter, call, layer, args, kwargs)
    return CutRecomputation(adapter, call, layer, args, kwargs, batch, samples).run()


def _dims(x):
    """`x`'s static shape as a list, or None where its rank is unknown."""
    return None if x.shape.rank is None else x.shape.as_list()


def _tensors(values):
    """The tensors of what a cut kept (`_core.kept`: tensors, structures of them, None)."""
    return [x for v in values for x in tf.nest.flatten(v) if tf.is_tensor(x)]


def _loop(count, body, state, first=0):
    """`state` through `body(k, state)` for k in [first, count), one iteration at a time
    (`count` may be a tensor)."""
    if isinstance(count, int) and count <= first:
        return state
    _, state = tf.while_loop(lambda k, _: k < count, lambda k, s: (k + 1, body(k, s)),
                             (tf.constant(first), state), parallel_iterations=1)
    return state


class CutRecomputation(_core.Recomputation):
    """`_core.Recomputation` run on cuts of `samples` samples of a batch of `batch`."""

    uniform = True  # every whole cut of `samples` samples (the rest apart): joined by `stack`

    def __init__(self, adapter, call, layer, args, kwargs, batch, samples):
        super().__init__(adapter, call, layer, args, kwargs)
        self.batch, self.samples, self.leading = batch, samples, batch
        self.whole, self.rest = divmod(batch, samples)

    def _window(self, start, size):
        return _running.BatchWindow(start, size, self.batch, self.leading)

    def _is_cut(self, x):
        return x.shape.rank not in (None, 0) and x.shape[0] == self.leading

    def _array(self, dtype, element_shape):
        """A `tf.TensorArray` of one result of each loop cut (`self.whole` of them)."""
        return tf.TensorArray(dtype, size=self.whole, element_shape=element_shape)

    def _stacked(self, array, shape):
        """The results in `array` joined along the batch; `shape`: one result's (a list)."""
        if self.uniform and None not in shape[1:]:
            return tf.reshape(array.stack(), [-1] + list(shape[1:]))
        return array.concat()

    def _forward_cut(self, inputs, window, assigned=None, gates=(), running=None):
        """The call on `window`'s samples from the starting state: its outputs and the
        losses it added; what it keeps (`_core.kept`) in `running`."""
        ready = _core.after([_core.cut(x, window) for x in inputs], *gates)
        with self.adapter.replay_recording(self.layer, self.state, self.start,
                                           assigned) as losses:
            outputs = self._run_call(ready, self.legacy_seed, window=window, running=running)
        return outputs, losses

    def _results(self, outputs):
        """A cut's flat outputs, then the Keras masks of those the first cut's carried."""
        flat = tf.nest.flatten(outputs)
        return flat + [self.adapter.output_mask(o) for o, masked in zip(flat, self.masked)
                       if masked]

    def _kept_values(self, tensors):
        """What a whole cut kept (`_core.kept`), its tensors `tensors` (the loop's arrays'
        entries) in the first cut's structures."""
        tensors = iter(tensors)
        return [tf.nest.pack_sequence_as(s, [next(tensors) if tf.is_tensor(x) else x
                                             for x in tf.nest.flatten(s)])
                for s in self.kept_structures]

    def _kept(self):
        """A `_core._RunningCall` of the layer: what a cut keeps, or replays."""
        return _core._RunningCall(self.layer, cut=True)

    def _cuttable(self, outputs, losses, assigned, window):
        """Whether the first cut's run says the call may run by cuts: no loss added, every
        output (and its Keras mask) the cut's samples, only random states assigned, every
        draw the batch's (`window.unwindowed`)."""
        flat = tf.nest.flatten(outputs)
        randoms = {id(v) for v in self.adapter.random_states(self.layer)}
        masks = [m for m in map(self.adapter.output_mask, flat) if m is not None]
        return not losses and not window.unwindowed and all(
            _core._is_float_tensor(o) and o.shape.rank and window.holds(o.shape)
            for o in flat) and all(
            tf.is_tensor(m) and m.shape.rank and window.holds(m.shape)
            for m in masks) and all(key in randoms for key in assigned)

    def _first_cut(self, inputs):
        """The call on the first cut, from the starting state; None where the call must run
        whole (a state variable made by this call: not built yet; `_cuttable`), else its
        outputs (the random states it assigned written once, as one call's)."""
        adapter = self.adapter
        self.cutting = False
        self.state = adapter.state_variables(self.layer)
        keys = [id(adapter.tf_variable(v)) for v in self.state]
        if any(key not in self.pre for key in keys):
            return None
        self.start = [self.pre[key] for key in keys]
        assigned, kept, window = {}, self._kept(), self._window(0, self.samples)
        first, losses = self._forward_cut(inputs, window, assigned, running=kept)
        if not self._cuttable(first, losses, assigned, window):
            return None
        self.cutting = True
        for variable, value in assigned.values():
            variable.assign(value)
        self.masked = [self.adapter.output_mask(o) is not None for o in tf.nest.flatten(first)]
        self.kept_structures = list(kept.values)
        return first

    def _joined(self, first, parts):
        """The call's flat outputs, each joined from `parts` (a list per flat result of a
        cut, `_results`), their Keras masks joined likewise; what `forward` returns."""
        outputs, joined = tf.nest.flatten(first), []
        for part, o in zip(parts, self._results(first)):
            j = tf.concat(part, 0) if len(part) > 1 else part[0]
            j.set_shape([self.leading] + o.shape[1:].as_list())
            joined.append(j)
        joined, masks = joined[:len(outputs)], iter(joined[len(outputs):])
        for j, masked in zip(joined, self.masked):
            if masked:
                self.adapter.set_output_mask(j, next(masks))
        self.outputs = tf.nest.pack_sequence_as(first, joined)
        self.differentiable = list(range(len(joined)))
        return joined, self.backward

    def forward(self, *inputs):
        with _tf.pause_outer_tapes():
            first = self._first_cut(inputs)
            if first is None:
                return super().forward(*inputs)
            flat = self._results(first)
            ready = _core.after(inputs, *flat)  # the other cuts after the first
            # what each whole cut keeps, by cut: the first cut's at 0, the loop's after it
            self.kept = [tf.TensorArray(v.dtype, size=self.whole).write(0, v)
                         for v in _tensors(self.kept_structures)]

            def body(k, state):
                arrays, kept_arrays = state
                window = self._window((k + 1) * self.samples, self.samples)
                kept = self._kept()
                outs, _ = self._forward_cut(ready, window, running=kept)
                values = _tensors(kept.values)
                return ([a.write(k, o) for a, o in zip(arrays, self._results(outs))],
                        [a.write(k + 1, v) for a, v in zip(kept_arrays, values)])

            parts = [[o] for o in flat]
            if self.whole > 1:
                arrays, self.kept = _loop(self.whole - 1, body, (
                    [tf.TensorArray(o.dtype, size=self.whole - 1, element_shape=o.shape)
                     for o in flat], self.kept))
                for part, a, o in zip(parts, arrays, flat):
                    part.append(self._stacked(a, o.shape.as_list()))
            if self.rest:
                window = self._window(self.whole * self.samples, self.rest)
                self.rest_kept = self._kept()
                last, _ = self._forward_cut(ready, window, gates=[p[-1] for p in parts],
                                            running=self.rest_kept)
                for part, o in zip(parts, self._results(last)):
                    part.append(o)
        self.inputs, self.loss_slots, self.losses = inputs, [], []
        return self._joined(first, parts)

    def _cut_gradients(self, dys, variables, window, gates, kept):
        """The gradients of the inputs and `variables` on `window`'s samples, what the cut's
        forward pass kept replayed from `kept`."""
        ready = _core.after([_core.cut(x, window) for x in self.inputs], *gates)
        pieces = [None if d is None else _core.cut_rows(d, window) for d in dys]  # (batch-major)
        tape, recomputed, losses = self._recompute(ready, variables, gates[0], window,
                                                   kept.replay())
        targets, seeds = self._targets(recomputed, losses, pieces)
        grads = tape.gradient(targets, list(ready) + variables, output_gradients=seeds)
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                for g in grads]

    def backward(self, *dys, variables=None):
        if not self.cutting:
            return super().backward(*dys, variables=variables)
        variables = list(variables or [])
        first_dy = next((d for d in dys if d is not None), None)
        targets = list(self.inputs) + variables
        n = len(self.inputs)
        cut = [i for i, x in enumerate(targets) if i < n and self._is_cut(x)]
        whole = [i for i in range(len(targets)) if i not in cut]
        nones = set()

        def shape(i, size):
            x = targets[i]
            return [size] + x.shape[1:].as_list() if i in cut else x.shape.as_list()

        def dtype(i):
            return targets[i].dtype.base_dtype

        def summed(i):  # float32 for half precision
            return tf.float32 if dtype(i) in HALF else dtype(i)

        def zeros(i, window=None, dtype=None):
            x = _core.cut(targets[i], window) if i in cut else targets[i]
            return tf.zeros(x.shape, dtype or x.dtype.base_dtype) \
                if x.shape.is_fully_defined() else tf.zeros_like(x, dtype)

        def gradients(window, gates, kept):
            grads = self._cut_gradients(dys, variables, window, gates, kept)
            nones.update(i for i, g in enumerate(grads) if g is None)
            return [zeros(i, window) if g is None else g for i, g in enumerate(grads)]

        def body(k, state):
            arrays, sums = state
            kept = self._kept()
            kept.values = self._kept_values([a.read(k) for a in self.kept])
            grads = gradients(self._window(k * self.samples, self.samples), [first_dy], kept)
            return ([a.write(k, grads[i]) for a, i in zip(arrays, cut)],
                    [s + tf.cast(grads[i], s.dtype) for s, i in zip(sums, whole)])

        with _tf.ordered_stateful_ops() as order:
            mark = _core.graph_mark()
            size = self.samples if self.uniform else None
            arrays, sums = _loop(self.whole, body, (
                [self._array(dtype(i), shape(i, size)) for i in cut],
                [zeros(i, dtype=summed(i)) for i in whole]))
            parts = {i: [self._stacked(a, shape(i, None))] for a, i in zip(arrays, cut)}
            totals = dict(zip(whole, sums))
            if self.rest:
                gates = [first_dy] + [p[0] for p in parts.values()] + sums
                grads = gradients(self._window(self.whole * self.samples, self.rest), gates,
                                  self.rest_kept)
                for i in cut:
                    parts[i].append(grads[i])
                for i in whole:
                    totals[i] = totals[i] + tf.cast(grads[i], totals[i].dtype)
            grads = [None if i in nones else
                     tf.concat(parts[i], 0) if i in cut and len(parts[i]) > 1 else
                     parts[i][0] if i in cut else tf.cast(totals[i], dtype(i))
                     for i in range(len(targets))]
            grads = [order.mark(g) for g in grads]
            reads = _core.reads_since(mark)
        grads = _core.after(grads, *reads)
        return _core.after(grads[:n], *grads[n:]), grads[n:]


class DynamicCutRecomputation(CutRecomputation):
    """`CutRecomputation` where the batch's size, or the cut's (`samples`, a scalar tensor
    where the rule reads a sequence length), is known only when the step runs -- tf_keras's
    `fit` traces its step with an unknown batch: the first cut, then a `tf.while_loop` over
    the others, the last one holding the rest; the tensors cut are those whose leading axis
    is the first floating input's (`first`) when traced, the results joined by
    `TensorArray.concat`."""

    uniform = False

    def __init__(self, adapter, call, layer, args, kwargs, first, samples):
        _core.Recomputation.__init__(self, adapter, call, layer, args, kwargs)
        self.samples, self.leading = samples, first.shape[0]
        self.batch = tf.shape(first)[0] if self.leading is None else self.leading
        self.whole, self.rest = (self.batch + samples - 1) // samples, 0  # every cut: a loop's

    def _window(self, start, size=None):
        """The cut from `start`: `samples` samples, or the rest (`size` is not used); its
        size a Python int where it is known when traced (the first cut of a batch known
        then, in cuts of a known size)."""
        ints = all(isinstance(n, int) for n in (start, self.samples, self.batch))
        size = min(self.samples, self.batch - start) if ints \
            else tf.minimum(self.samples, self.batch - start)
        return _running.BatchWindow(start, size, self.batch, self.leading)

    def _array(self, dtype, element_shape):
        shape = [None] + list(element_shape[1:]) if element_shape else element_shape  # (a scalar)
        return tf.TensorArray(dtype, size=self.whole, element_shape=shape, infer_shape=False)

    def forward(self, *inputs):
        with _tf.pause_outer_tapes():
            first = self._first_cut(inputs)
            if first is None:
                return _core.Recomputation.forward(self, *inputs)
            flat = self._results(first)
            ready = _core.after(inputs, *flat)  # the other cuts after the first
            kept = _tensors(self.kept_structures)  # by cut: the first cut's at 0

            def body(k, state):
                arrays, kept_arrays = state
                kept = self._kept()
                outs, _ = self._forward_cut(ready, self._window(k * self.samples), running=kept)
                return ([a.write(k, o) for a, o in zip(arrays, self._results(outs))],
                        [a.write(k, v) for a, v in zip(kept_arrays, _tensors(kept.values))])

            arrays, self.kept = _loop(self.whole, body, (
                [self._array(o.dtype, _dims(o)).write(0, o) for o in flat],
                [self._array(v.dtype, _dims(v)).write(0, v) for v in kept]), first=1)
            parts = [[a.concat()] for a in arrays]
        self.inputs, self.loss_slots, self.losses = inputs, [], []
        return self._joined(first, parts)
