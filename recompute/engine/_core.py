"""The recomputation itself: one `tf.custom_gradient` around a layer's `call`.

Forward pass: the call runs out of reach of the tapes already recording
(`_tf.pause_outer_tapes`), so none of its activations are kept; only its inputs (and a few small state snapshots: seeds, moving
statistics) survive until the backward pass. Backward pass: the call runs again
under a fresh tape, in the same Keras call context (training flag, mixed
precision autocast), starting from the state the forward pass started from --
so it draws the same dropout masks -- and without leaving any state change
behind (moving statistics, seeds, metrics and `add_loss` are updated once, by
the forward pass). Turning recomputation on changes only memory and time.
"""

import contextlib
import inspect
import types
import warnings
import weakref

import tensorflow as tf

from ..adapters import _tf
from .._errors import created_in_recomputation
from . import _running

_legacy_rng_warned = False


class _RunningCall(_running.RunningCall):
    """A recomputed call of `layer` while it runs (`recomputed_call`), and what its
    forward pass keeps for its recomputation (`kept`)."""

    def __init__(self, layer, cut=False):
        super().__init__(layer)
        self.values, self.replaying, self.next = [], False, 0
        self.cut = cut  # a cut's of a call run in cuts of its batch (`kept`'s `in_cuts`)
        # in the recomputation: the forward pass's outputs, or a function making them (`forward_outputs`)
        self.forward_outputs = None

    def replay(self):
        self.replaying, self.next = True, 0
        return self

    def take(self):
        """The next kept result, in the order the forward pass kept them."""
        self.next += 1
        if self.next > len(self.values):
            self.check_replayed()
        return self.values[self.next - 1]

    def check_replayed(self):
        if self.next != len(self.values):
            raise RuntimeError(
                f"recompute_grad: layer '{self.layer.name}' kept {len(self.values)} "
                f"results with `kept` in the forward pass but asked for {self.next} "
                "when recomputed; `call` must run the same code each time.")


def kept(compute, in_cuts=True):
    """`compute()` (tensors, or None), computed once per training step.

    Inside a recomputed call, the forward pass computes it and keeps the result
    until the backward pass, and the recomputation gets that result back
    instead of computing it again (the calls are matched in order). Elsewhere
    it is simply `compute()`. For what is cheap to keep and costly or
    impossible to recompute: an attention dropout's decision, kept as bits
    (`_attention`), 1 bit per entry against a float random draw per entry.
    Inside a cut of a call run in cuts of its batch (`_cuts_tf`), kept by cut, or
    with `in_cuts=False` computed in each pass (what would weigh more kept than drawn).
    """
    call = _running.innermost(_RunningCall)
    if call is None or (call.cut and not in_cuts):
        return compute()
    if call.replaying:
        return call.take()
    call.values.append(compute())
    return call.values[-1]


def recomputing(layer):
    """Whether the innermost recomputed call running is `layer`'s (on TensorFlow: its forward
    pass or its recomputation; `replaying` tells which)."""
    call = _running.innermost(_RunningCall)
    return call is not None and call.layer is layer


def replaying():
    """Whether the innermost recomputed call running is its recomputation (the backward
    pass's run of it), not its forward pass."""
    call = _running.innermost(_RunningCall)
    return call is not None and call.replaying


def forward_outputs():
    """In the recomputation of a recomputed call (`replaying`): the call's outputs from its
    forward pass, flat (`tf.nest.flatten`'s order), those of the cut's samples where it runs
    in cuts of its batch (`_cuts_tf`); None elsewhere.

    For a gradient that can be taken from an output instead of from what makes it (a
    LayerNorm's, `recompute.bert4keras._norm_from_output`): the step holds the outputs anyway
    (the next layer's input), and the recomputation then need not make them again."""
    call = _running.innermost(_RunningCall)
    if call is None or not call.replaying or call.forward_outputs is None:
        return None
    if callable(call.forward_outputs):  # made when first asked for: no op where none asks
        call.forward_outputs = call.forward_outputs()
    return call.forward_outputs


def _is_float_tensor(value):
    return (
        tf.is_tensor(value)
        and not isinstance(value, tf.Variable)
        and isinstance(value.dtype, tf.DType)  # not a Keras 3 variable (its dtype is a name)
        and (value.dtype.is_floating or value.dtype.is_complex)
    )


def _is_other_tensor(value):
    """A dense tensor that is not floating-point: a mask, token ids."""
    return isinstance(value, tf.Tensor) and not _is_float_tensor(value)


def float_tensors(structure):
    """The floating-point tensors (not variables) of a nested structure, in order."""
    return [value for value in tf.nest.flatten(structure) if _is_float_tensor(value)]


def cut(value, window):
    """`value`'s samples in `window` (a `_running.BatchWindow`) where `value` is a tensor whose
    leading axis is the batch's (`window.leading`); else `value`."""
    if (window is None or not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0)
            or value.shape[0] != window.leading):
        return value
    return cut_rows(value, window)


def cut_rows(value, window):
    """`value`'s samples in `window` (a `_running.BatchWindow`): `value` is a tensor whose
    leading axis is the batch (a gradient of the call's outputs, `_cuts_tf`)."""
    rank = value.shape.rank
    start = tf.stack([tf.cast(window.start, tf.int32)] + [0] * (rank - 1))
    size = tf.stack([tf.cast(window.size, tf.int32)] + [-1] * (rank - 1))
    piece = tf.slice(value, start, size)
    piece.set_shape([window.size if isinstance(window.size, int) else None] + value.shape[1:])
    return piece


def _warn_legacy_rng(layer):
    global _legacy_rng_warned
    if _legacy_rng_warned:
        return
    _legacy_rng_warned = True
    warnings.warn(
        f"recompute_grad: layer '{layer.name}' contains tf_keras layers that draw "
        "random numbers with legacy stateful ops, which cannot be replayed. "
        "The recomputation sees exactly the forward pass's dropout masks (gradients "
        "are exact), but the masks differ from those of a run without RECOMPUTE. "
        "For results identical to RECOMPUTE=0, call "
        "`tf_keras.backend.experimental.enable_tf_random_generator()` before "
        "building the model (and seed with `tf_keras.utils.set_random_seed`).",
        stacklevel=5,
    )


def _numeric(t):
    """Whether `after` gates `t` through its data (not a string, variant or resource)."""
    return t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex or t.dtype == tf.bool


def after(tensors, *gates):
    """`tensors`, made to depend on `gates` so that graph executors wait for them.

    The recomputation waits for the incoming gradient `dy`. Without this, a
    graph executor may run the recomputation as soon as what it reads exists
    -- during the forward pass -- and keep its activations alive until the
    backward pass reaches the block. That holds for the inputs and for the
    replayed state alike: the seeds of the dropout masks come from snapshots
    taken in the forward pass, so ungated, every block's recomputed masks
    would be drawn during the forward pass and wait in memory (measured: about
    5 instead of 1.5 MiB per block per sample at BERT-base size).

    And the gradients a block returns for its inputs wait for the gradients of
    its weights, so that the block below starts its recomputation only once
    this block's recomputed activations are no longer needed. Otherwise an
    executor with other work to do -- the other replicas of a
    `MirroredStrategy` on one host, or any independent branch -- may postpone
    weight-gradient ops off the critical path while the input gradients run
    ahead, and hold the recomputed activations of several blocks at once
    (measured with 2 replicas on one CPU: 15 instead of 4.7 MiB per sample
    per replica).

    A data dependency is used because XLA ignores control dependencies: `x + 0`
    computed from the gates. Where TensorFlow sees no GPU and XLA does not compile
    the graph, it is a slice of the whole tensor whose start (zeros) is computed from
    the gates instead: TensorFlow's CPU kernel hands on the input's buffer, with no
    copy and no pass over the elements, where `x + 0` reads and writes every element
    of every gated tensor (1.8 ms a [4, 512, 3072] float on this project's CPUs;
    docs/attention.md, "The recomputation's gate: a view, not a sum"). On a GPU the
    slice's start would be copied to the host, which would wait for the gates.
    Eager execution is ordered already.
    """
    gates = [g.values if isinstance(g, tf.IndexedSlices) else g for g in gates if g is not None]
    if tf.executing_eagerly() or not gates:
        return list(tensors)
    firsts = [tf.cast(tf.reshape(g, [-1])[:1], tf.float32) for g in gates]
    elem = tf.reduce_max(firsts[0] if len(firsts) == 1 else tf.concat(firsts, 0))
    finite = tf.cast(elem, tf.bool)
    ready = tf.equal(finite, finite)  # True, once the gates exist
    zero = tf.where(ready, 0.0, float("nan"))
    view = not (_tf.in_xla_context() or _tf.sees_a_gpu())
    origin = tf.where(ready, 0, 1) if view else None  # an int32 0

    def gated(x):
        if isinstance(x, tf.IndexedSlices):
            return tf.IndexedSlices(gated(x.values), x.indices, x.dense_shape)
        numeric = _numeric(x)
        if origin is not None and numeric and x.shape.rank:  # a view: no copy
            rank = x.shape.rank
            y = tf.slice(x, tf.fill([rank], origin), tf.fill([rank], -1))
            y.set_shape(x.shape)
            return y
        if x.dtype == tf.bool:
            return tf.logical_or(x, tf.cast(zero, tf.bool))
        if numeric:
            return x + tf.cast(zero, x.dtype)
        with tf.control_dependencies([zero]):
            return tf.identity(x)

    return [None if x is None else gated(x) for x in tensors]


def graph_mark():
    """The number of ops of the graph being built (None in eager mode): the start of a
    region whose resource reads `reads_since` lists."""
    if tf.executing_eagerly():
        return None
    return len(tf.compat.v1.get_default_graph().get_operations())


def reads_since(mark):
    """A value read by each op built since `mark` that reads a resource (a variable, an RNG state).

    The recomputation's reads of the weights must run before the optimizer
    writes them. Automatic control dependencies order them with control edges,
    but Grappler's dependency optimizer can remove such an edge: its transitive
    reduction drops read -> write as implied by a longer path, read -> input
    gradient -> other layers' gradients -> one `IdentityN` that joins every
    gradient (the all-reduce of `tf.distribute`'s default replica context)
    -> that weight's gradient -> write, and afterwards the same optimizer
    bypasses the `IdentityN`, which cuts that path. A weight gradient needs
    the recomputed activations, not the weight itself (d(xW)/dW = x), so then
    nothing orders the read before the write, and a late read sees the
    updated weight (docs/recompute.md, "Ordering against the optimizer";
    tests/helpers/step_ordering.py). Gradients made to depend
    on these values through data (`after`) are ordered after the reads in
    every graph optimization.
    """
    if mark is None:
        return []

    found = []
    for op in tf.compat.v1.get_default_graph().get_operations()[mark:]:
        if any(t.dtype == tf.resource for t in op.inputs):
            out = next((t for t in op.outputs if _numeric(t)), None)
            if out is not None:
                found.append(out)
    return found


def _forbid_creation(layer, adapter):
    def creator(next_creator, **kwargs):
        what = f"a variable ('{kwargs.get('name')}')"
        raise created_in_recomputation(layer.name, what, adapter.name == "tf_keras")

    return tf.variable_creator_scope(creator)


# --------------------------------------------- a tape opened inside an eager call

_LIBRARIES = frozenset({"builtins", "keras", "numpy", "recompute", "tensorflow", "tf_keras"})
_tape_cache = weakref.WeakKeyDictionary()  # layer class -> {code object: opens a tape}


def _unwrap(fn):
    """The function behind a (bound, `recompute_grad`-decorated, `functools.wraps`-ed) `fn`."""
    for _ in range(32):
        fn = getattr(fn, "__func__", fn)
        inner = getattr(fn, "__recompute_grad_wrapped__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn if isinstance(fn, types.FunctionType) else None


def _user_function(value):
    """`value` as a function defined outside the libraries we know open no tape in a call
    to differentiate (Keras, TensorFlow), or None."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    fn = _unwrap(value) if callable(value) else None
    if fn is None or (fn.__module__ or "").split(".")[0] in _LIBRARIES:
        return None
    return fn


def _opens_tape(fn, cls, seen):
    """True if `fn`'s code names `GradientTape`, or code it reaches does.

    Reached: nested functions, lambdas and comprehensions; methods of `cls` and
    functions of `fn`'s module that the code names. A static scan: a tape class
    reached under another name, or through code outside those, is not seen.
    """
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        if code in seen:
            continue
        seen.add(code)
        if "GradientTape" in code.co_names:
            return True
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for name in code.co_names:
            for value in (inspect.getattr_static(cls, name, None), fn.__globals__.get(name)):
                other = _user_function(value)
                if other is not None and other.__code__ not in seen:
                    if _opens_tape(other, cls, seen):
                        return True
    return False


def _tape_opener(call, layer, layers):
    """The qualified name of a function that opens a `tf.GradientTape` (statically, see
    `_opens_tape`), or None. Read: `call` (of `layer`), the calls of `layers` and the
    functions of their `Lambda` layers; not Keras's and TensorFlow's own code (tf_keras's
    `Lambda` opens a tape only to list the variables it reads). Cached per class and function."""
    entries = [(call, type(layer))]
    for lyr in layers:
        entries.append((lyr.call, type(lyr)))
        entries.append((lyr.__dict__.get("function"), type(lyr)))  # a `Lambda` layer's
    for entry, cls in entries:
        fn = _user_function(entry)
        if fn is None:
            continue
        try:
            found = _tape_cache.setdefault(cls, {})
        except TypeError:  # a class that cannot be weakly referenced: no cache
            found = {}
        if fn.__code__ not in found:
            found[fn.__code__] = _opens_tape(fn, cls, set())
        if found[fn.__code__]:
            return fn.__qualname__
    return None


def check_recomputable(adapter, layer, xs):
    """Raises unless `layer`'s call, on the float inputs `xs`, can be recomputed here:
    not under forward-mode autodiff, not in a graph's `tf.while_loop` body."""
    trainable = [adapter.tf_variable(v).handle for v in layer.trainable_weights]
    if _tf.forward_accumulator_watches(xs + trainable):
        raise NotImplementedError(
            "`recompute_grad` defines reverse-mode gradients only; it cannot be "
            "used under `tf.autodiff.ForwardAccumulator` (forward-mode autodiff). "
            f"Received: a forward accumulator watching layer '{layer.name}'. "
            "Run this computation with RECOMPUTE=0 or inside "
            "`recompute_scope(False)`."
        )

    if _tf.in_while_loop_body():
        raise NotImplementedError(
            "`recompute_grad` cannot recompute a call inside the body of a "
            "`tf.while_loop` built in a graph (TensorFlow's while-loop gradient "
            "cannot take the recomputation's variable reads). Received: layer "
            f"'{layer.name}' called in a while loop, as Keras runs an RNN cell "
            "with `unroll=False` in `tf.function` or `fit`. Decorate the `call` "
            "of the layer that runs the loop (e.g. a `keras.layers.RNN` subclass) "
            "instead, or use `unroll=True`."
        )


def recomputed_call(adapter, call, layer, args, kwargs):
    """Runs `call(layer, *args, **kwargs)` so that its activations are recomputed for the gradient."""
    return Recomputation(adapter, call, layer, args, kwargs).run()


def _refuse_tape_opener(call, layer, layers):
    """Raises, in eager mode, if the call opens a `tf.GradientTape` (see `_tape_opener`)."""
    if not _tf.context_executing_eagerly():
        return
    opener = _tape_opener(call, layer, layers)
    if opener is not None:
        raise NotImplementedError(
            "`recompute_grad` cannot recompute, in eager mode, a call that opens "
            "its own `tf.GradientTape`: the eager forward pass pauses every tape "
            "of the thread (TensorFlow cannot pause only the tapes outside the "
            "call), so that tape would record nothing and its gradients would be "
            f"None or zero. Received: layer '{layer.name}', whose `{opener}` uses "
            "`GradientTape`. Run the step in a `tf.function` or with `model.fit` "
            "(not `run_eagerly=True`), where such a tape is exact, or run this "
            "model with RECOMPUTE=0 or inside `recompute_scope(False)`."
        )


def _explained_none_error(e, layer):
    """`e`, raised in the eager forward pass, with a hint at a tape opened in the call (one
    the static check could not see), or None if it is not what such a tape's None raises."""
    exact_type = type(e) in (TypeError, ValueError, AttributeError)
    if not (exact_type and "None" in str(e) and _tf.context_executing_eagerly()):
        return None
    return type(e)(
        f"{e}\n\nrecompute_grad: this was raised in the eager forward pass "
        f"of layer '{layer.name}', which runs with every GradientTape of the "
        "thread paused. If the call opens a `tf.GradientTape` (one not named "
        "`GradientTape` in its code), that tape records nothing there and its "
        "gradients are None: run the step in a `tf.function` or with "
        "`model.fit`, or with RECOMPUTE=0."
    )


class Recomputation:
    """One recomputed call of `layer`: `forward` runs it off the tapes and keeps its
    inputs and starting state, `backward` runs it again under a tape from that state
    and returns the gradients, `unpack` puts the results back in the call's structure
    (the shape of PyTorch's `CheckpointFunction`). `run` does the three through one
    `tf.custom_gradient`.

    Only floating tensors go through the custom gradient: the differentiable inputs
    (a tensor passed twice is one input), the call's floating outputs and the losses
    it passes to `add_loss`. Every other leaf (None, Python values, integer masks,
    variables) is passed and returned as the call has it, as without recomputation.
    """

    def __init__(self, adapter, call, layer, args, kwargs):
        self.adapter, self.call, self.layer = adapter, call, layer
        self.structure = (args, kwargs)
        self.flat = tf.nest.flatten(self.structure)
        self.slot_of = {}  # id(tensor) -> its index among the differentiable inputs
        self.xs = []
        for value in float_tensors(self.flat):
            if id(value) not in self.slot_of:
                self.slot_of[id(value)] = len(self.xs)
                self.xs.append(value)
        check_recomputable(adapter, layer, self.xs)
        self.layers = adapter.sublayers(layer)
        _refuse_tape_opener(call, layer, self.layers)

        self.reenter = adapter.capture_call_state(layer)
        before = adapter.state_variables(layer)
        self.pre = {id(adapter.tf_variable(v)): adapter.tf_variable(v).read_value() for v in before}
        self.legacy = adapter.legacy_rng(self.layers)
        self.legacy_seed = self.legacy.draw_seed() if self.legacy is not None else None
        self.created = {}  # variables the forward call creates (first call): their initial values
        self.running = _RunningCall(layer)

    def run(self):
        # custom_gradient needs at least one input tensor: with no differentiable
        # input (only the weights get gradients), pass a dummy scalar.
        forward = tf.custom_gradient(self.forward)
        return self.unpack(list(forward(*self.xs) if self.xs else forward(tf.zeros([]))))

    def _record_creation(self, next_creator, **kw):
        variable = next_creator(**kw)
        self.created[id(variable)] = variable.read_value()
        return variable

    def _run_call(self, inputs, seed, replay=False, gate=None, window=None, running=None,
                  forward=None):
        """The call on `inputs` (its floating-point inputs); with `gate` (the recomputation:
        the incoming gradient), its other tensor inputs -- a padding mask, token ids -- wait
        for `gate` too (`after`): what the call computes from them alone (a mask broadcast to
        [batch, heads, seq, seq]) would otherwise run in the forward pass and wait there.
        With `window` (a `_running.BatchWindow`: `recompute.engine._cuts_tf`), `inputs` are
        the window's samples, the other tensors of the batch's length are cut to them, the
        random draws inside draw the window's numbers, and `kept` keeps in `running` (the
        cut's `_RunningCall`; None: nothing is kept). `forward`: in the recomputation, a
        function making the forward pass's outputs the call gets from `forward_outputs`."""
        others = [v for v in self.flat if gate is not None and _is_other_tensor(v)]
        gated = {id(v): w for v, w in zip(others, after(others, gate) if others else [])}
        new_flat = [inputs[self.slot_of[id(v)]] if id(v) in self.slot_of
                    else cut(gated.get(id(v), v), window) for v in self.flat]
        call_args, call_kwargs = tf.nest.pack_sequence_as(self.structure, new_flat)
        if window is not None:
            call = running or _running.RunningCall(self.layer)
        else:
            call = self.running.replay() if replay else self.running
        if forward is not None:
            call.forward_outputs = forward
        with _running.calls.entered(call), \
                (_running.windows.entered(window) if window is not None
                 else contextlib.nullcontext()):
            if self.legacy is None:
                return self.call(self.layer, *call_args, **call_kwargs)
            with self.legacy.replay(seed) as replayed:
                outputs = self.call(self.layer, *call_args, **call_kwargs)
            if replayed.draws:
                _warn_legacy_rng(self.layer)
            return outputs

    def forward(self, *inputs):
        """The call off the tapes; its floating outputs and losses, and `backward`."""
        adapter = self.adapter
        added_losses = adapter.track_losses(self.layers)
        with _tf.pause_outer_tapes(), tf.variable_creator_scope(self._record_creation):
            try:
                outputs = self._run_call(inputs, self.legacy_seed)
            except (TypeError, ValueError, AttributeError) as e:
                explained = _explained_none_error(e, self.layer)
                if explained is None:
                    raise
                raise explained from e
        self.inputs, self.outputs, self.loss_slots = inputs, outputs, added_losses()
        flat_outputs = tf.nest.flatten(outputs)
        self.differentiable = [i for i, out in enumerate(flat_outputs) if _is_float_tensor(out)]
        # Losses the call passes to `add_loss` become outputs too, so that their
        # gradients flow through the recomputation like the call's results.
        self.losses = [lst[i] for lst, i in self.loss_slots]
        self.state = adapter.state_variables(self.layer)
        self.start = []
        for v in self.state:
            key = id(adapter.tf_variable(v))
            self.start.append(self.pre[key] if key in self.pre else self.created[key])
        return [flat_outputs[i] for i in self.differentiable] + self.losses, self.backward

    def backward(self, *dys, variables=None):
        """The call again under a tape, from the forward pass's state; the gradients of
        the inputs and of `variables` (the weights it read)."""
        variables = list(variables or [])
        first_dy = next((d for d in dys if d is not None), None)
        with _tf.ordered_stateful_ops() as order:
            mark = graph_mark()
            ready = after(self.inputs, first_dy)
            tape, recomputed, recomputed_losses = self._recompute(ready, variables, first_dy)
            reads = reads_since(mark)
            targets, seeds = self._targets(recomputed, recomputed_losses, dys)
            # An input or weight the outputs do not depend on gets None, as
            # without recomputation (a zero would still move it under weight decay).
            grads = tape.gradient(targets, list(ready) + variables, output_gradients=seeds)
            grads = [order.mark(g) for g in grads]
        n = len(ready)
        # The gradients wait for every read of the recomputation, so that an
        # optimizer cannot update a weight before it is read (`reads_since`).
        grads = after(grads, *reads)
        # The block below recomputes once this block's gradients are all done (see `after`).
        return after(grads[:n], *grads[n:]), grads[n:]

    def _recompute(self, ready, variables, first_dy, window=None, running=None):
        """The call run again on `ready` under a tape watching it and `variables`: the tape,
        the call's outputs and the losses it added. With `window`, on its samples, what its
        forward pass kept replayed from `running` (`_run_call`)."""
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(ready)
            tape.watch(variables)
            # The replayed state waits for the gradient too (see `after`).
            with self.reenter(), _forbid_creation(self.layer, self.adapter), \
                    self.adapter.replay_state(
                        self.layer, self.state, after(self.start, first_dy)) as recomputed_losses:
                # The legacy seed is a forward-pass tensor too: gated like the state.
                seed = after([self.legacy_seed], first_dy)[0] if self.legacy is not None else None
                forward = lambda: [cut(o, window) for o in tf.nest.flatten(self.outputs)]  # noqa: E731
                recomputed = self._run_call(ready, seed, replay=True, gate=first_dy,
                                            window=window, running=running, forward=forward)
        (self.running if window is None else running).check_replayed()
        if len(recomputed_losses) != len(self.losses):
            raise RuntimeError(
                f"recompute_grad: layer '{self.layer.name}' added {len(self.losses)} "
                f"losses in the forward pass but {len(recomputed_losses)} "
                "when recomputed; `call` must add the same losses each time."
            )
        return tape, recomputed, list(recomputed_losses)

    def _targets(self, recomputed, recomputed_losses, dys):
        """The recomputed outputs and losses that get a gradient, and those gradients."""
        flat = tf.nest.flatten(recomputed)
        flat = [flat[i] for i in self.differentiable] + recomputed_losses
        pairs = [(out, dy) for out, dy in zip(flat, dys) if dy is not None and _is_float_tensor(out)]
        return [out for out, _ in pairs], [dy for _, dy in pairs]

    def unpack(self, flat_results):
        """The custom gradient's results put back into the call's output structure; the
        losses' copies connected to the tape replace those computed off it."""
        n_outputs = len(flat_results) - len(self.loss_slots)
        for (lst, i), loss in zip(self.loss_slots, flat_results[n_outputs:]):
            lst[i] = loss
        flat_outputs = tf.nest.flatten(self.outputs)
        for i, result in zip(self.differentiable, flat_results[:n_outputs]):
            self.adapter.copy_output_mask(flat_outputs[i], result)
            flat_outputs[i] = result
        return tf.nest.pack_sequence_as(self.outputs, flat_outputs)
