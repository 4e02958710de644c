"""The recomputation itself: one `tf.custom_gradient` around a layer's `call`.

Forward pass: the call runs with every tape paused, so none of its activations
are kept; only its inputs (and a few small state snapshots) survive until the
backward pass. Backward pass: the state the forward pass started from is put
back (random-number states, moving statistics, metric variables), the call runs
again under a fresh tape in the same Keras call context, the gradient is taken,
and the state is set back to where the forward pass left it -- so turning
recomputation on changes neither the numbers nor the state, only memory and time.
"""

import warnings

import tensorflow as tf

from . import _tf

_LEGACY_RNG_WARNED = False


class VariableCreatedInRecomputationError(RuntimeError):
    """A layer tried to create a variable while its activations were being recomputed."""


def _is_float_tensor(value):
    return tf.is_tensor(value) and not isinstance(value, tf.Variable) and (
        value.dtype.is_floating or value.dtype.is_complex
    )


def _warn_legacy_rng(layer):
    global _LEGACY_RNG_WARNED
    if _LEGACY_RNG_WARNED:
        return
    _LEGACY_RNG_WARNED = True
    warnings.warn(
        f"recompute_grad: layer '{layer.name}' contains tf_keras layers that draw "
        "random numbers with legacy stateful ops, which cannot be replayed. "
        "The recomputation sees exactly the forward pass's dropout masks (gradients "
        "are exact), but the masks differ from those of a run without RECOMPUTE. "
        "For results identical to RECOMPUTE=0, call "
        "`tf_keras.backend.experimental.enable_tf_random_generator()` before "
        "building the model (and seed with `tf_keras.utils.set_random_seed`).",
        stacklevel=4,
    )


def _after(tensors, dy):
    """`tensors`, made to depend on `dy` so that graph executors wait for the gradient.

    Without this, a graph executor may run the recomputation as soon as the
    inputs exist -- during the forward pass -- and keep its activations alive.
    A data dependency (x + 0 computed from `dy`) is used because XLA ignores
    control dependencies. Eager execution is ordered already.
    """
    if tf.executing_eagerly() or dy is None:
        return list(tensors)
    first = tf.reshape(dy, [-1])[:1]
    elem = tf.reduce_max(tf.cast(first, tf.float32))
    finite = tf.cast(elem, tf.bool)
    zero = tf.where(tf.equal(finite, finite), 0.0, float("nan"))
    return [x + tf.cast(zero, x.dtype) for x in tensors]


def recomputed_call(adapter, call, layer, args, kwargs):
    """Runs `call(*args, **kwargs)` so that its activations are recomputed for the gradient."""
    structure = (args, kwargs)
    flat = tf.nest.flatten(structure)
    slot_of = {}  # id(tensor) -> index among the differentiable inputs
    xs = []
    for value in flat:
        if _is_float_tensor(value) and id(value) not in slot_of:
            slot_of[id(value)] = len(xs)
            xs.append(value)

    if _tf.forward_accumulator_watches(xs + [v.handle for v in _trainable(layer)]):
        raise NotImplementedError(
            "`recompute_grad` defines reverse-mode gradients only; it cannot be "
            "used under `tf.autodiff.ForwardAccumulator` (forward-mode autodiff). "
            f"Received: a forward accumulator watching the inputs of layer '{layer.name}'. "
            "Run this computation with RECOMPUTE=0 or outside `recompute_scope(True)`."
        )

    def rebuild(new_xs):
        new_flat = [new_xs[slot_of[id(v)]] if id(v) in slot_of else v for v in flat]
        new_args, new_kwargs = tf.nest.pack_sequence_as(structure, new_flat)
        return new_args, new_kwargs

    layers = adapter.sublayers(layer)
    reenter = adapter.capture_call_state(layer)
    before = adapter.state_variables(layer)
    pre = {id(v): v.read_value() for v in before}
    legacy = adapter.legacy_random_generators(layers)
    legacy_seed = None
    if legacy:
        _warn_legacy_rng(layer)
        legacy_seed = adapter.draw_legacy_seed(legacy)

    created = {}

    def record_creation(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created[id(variable)] = variable.read_value()
        return variable

    @tf.custom_gradient
    def forward(*inputs):
        call_args, call_kwargs = rebuild(inputs)
        with _tf.stop_recording(), tf.variable_creator_scope(record_creation):
            if legacy:
                with adapter.replay_legacy_rng(legacy, legacy_seed):
                    outputs = call(layer, *call_args, **call_kwargs)
            else:
                outputs = call(layer, *call_args, **call_kwargs)
        state = adapter.state_variables(layer)
        start = []
        for v in state:
            snapshot = pre.get(id(v), created.get(id(v)))
            if snapshot is None:
                raise RuntimeError(
                    f"recompute_grad: cannot find the starting value of state variable "
                    f"'{v.name}' of layer '{layer.name}'."
                )
            start.append(snapshot)

        def grad_fn(*dys, variables=None):
            variables = list(variables or [])
            first_dy = next((d for d in dys if d is not None), None)
            ready_inputs = _after(inputs, first_dy)
            end = [v.read_value() for v in state]
            for v, value in zip(state, start):
                v.assign(value)
            restore_python = adapter.save_python_state(layers)

            def forbid_creation(next_creator, **kwargs):
                raise VariableCreatedInRecomputationError(
                    f"Layer '{layer.name}' tried to create a variable "
                    f"('{kwargs.get('name')}') while its activations were being "
                    "recomputed for the backward pass. Variables must exist before "
                    "the recomputation: build the layer and every sublayer it calls "
                    "first (for example by calling the model once on a sample "
                    "batch, or with `layer.build(input_shape)`)."
                )

            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(ready_inputs)
                tape.watch(variables)
                re_args, re_kwargs = rebuild(ready_inputs)
                with reenter(), tf.variable_creator_scope(forbid_creation):
                    if legacy:
                        with adapter.replay_legacy_rng(legacy, legacy_seed):
                            recomputed = call(layer, *re_args, **re_kwargs)
                    else:
                        recomputed = call(layer, *re_args, **re_kwargs)
            restore_python()
            targets, seeds = [], []
            for out, dy in zip(tf.nest.flatten(recomputed), dys):
                if dy is not None and _is_float_tensor(out):
                    targets.append(out)
                    seeds.append(dy)
            grads = tape.gradient(
                targets, list(ready_inputs) + variables, output_gradients=seeds,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            for v, value in zip(state, end):
                v.assign(value)
            n = len(ready_inputs)
            return grads[:n], grads[n:]

        return outputs, grad_fn

    if not xs:
        # Nothing differentiable comes in; only the variables can get gradients.
        # custom_gradient needs at least one input, so pass a dummy scalar.
        dummy = tf.zeros([])
        slot_of[id(dummy)] = 0
        return forward(dummy)
    return forward(*xs)


def _trainable(layer):
    return [getattr(v, "_value", v) for v in layer.trainable_weights]
