"""`recompute_grad`: the public decorator."""

import functools
import inspect

import tensorflow as tf

from . import _backends, _config, _core, _tf


def _describe(obj):
    """`obj` for an error message; a tensor by its type, shape and dtype, never its values."""
    if tf.is_tensor(obj) or isinstance(obj, tf.Variable) or (
        hasattr(obj, "shape") and hasattr(obj, "dtype")
    ):
        dtype = getattr(obj.dtype, "name", obj.dtype)
        return f"a {type(obj).__name__} of shape {tuple(obj.shape)} and dtype {dtype}"
    return f"{obj!r} of type {type(obj).__name__}"


def _check_takes_self(fn):
    """Refuses a function that cannot be an instance method (a `@staticmethod`, a plain function)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the call will tell
        return
    first = params[0] if params else None
    if first is not None and first.kind == first.VAR_POSITIONAL:
        return  # `def call(*args, ...)`: `self` is args[0]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if first is not None and first.kind in positional and first.name == "self":
        return
    raise TypeError(
        "`recompute_grad` decorates the `call` method of a Keras layer, an instance "
        "method whose first parameter is `self` (not a `@staticmethod` or a function "
        "outside a layer class). "
        f"Received: `{fn.__qualname__}{inspect.signature(fn)}`. Define "
        "`def call(self, inputs, ...)` in the layer class, or decorate a layer "
        "instance's bound call: `layer.call = recompute_grad(layer.call)`."
    )


def _autographed(fn, status):
    """`fn`, converted by AutoGraph in graph mode the way tf_keras converts `call`.

    `status` is the AutoGraph status of the caller: a `call` that AutoGraph
    would not convert without the decorator is not converted with it either.
    """
    if tf.executing_eagerly():
        return fn
    return tf.__internal__.autograph.tf_convert(fn, status)


def recompute_grad(call):
    """Decorates a Keras layer's `call` so that its activations are recomputed in the backward pass.

    ```python
    from recompute import recompute_grad

    class Block(keras.layers.Layer):
        @recompute_grad
        def call(self, x, training=None, mask=None):
            ...
    ```

    With `RECOMPUTE=1` in the environment (read each time the layer runs) or
    inside `recompute.recompute_scope(True)`, and while a `tf.GradientTape` is
    recording (a custom loop, `model.fit`), the forward pass keeps only the
    call's inputs; everything computed inside is dropped and recomputed when
    the gradient is needed. Decorating every block of a deep model turns memory
    that grows with depth times the block's activations into depth times the
    block's inputs plus one block's activations.

    Nothing else changes: the loss and every gradient (inputs and all weights)
    are those of the undecorated layer (`None` for an input or weight the
    outputs do not depend on, as there) -- with dropout on, because the random
    state (Keras 3 `SeedGenerator`s, tf_keras `tf.random.Generator`s) is
    replayed in the recomputation and left where the plain run leaves it; and
    side effects (BatchNormalization moving statistics, metric updates,
    `add_loss`) happen once. When recomputation is off, or no tape is
    recording, the original `call` runs with no extra operation.

    Works for Keras 3 layers (TensorFlow backend) and tf_keras layers, in eager
    mode, `tf.function`, `jit_compile=True` and `model.fit`, and under mixed
    precision. Arguments may be nested lists/tuples/dicts of tensors; keyword
    arguments (`training`, `mask`, Python values) pass through; only floating
    tensors are differentiated; a tensor passed several times gets its gradient
    once. Outputs may be nested too: their floating tensors carry the gradient,
    every other leaf (`None`, Python values, integer tensors) is returned as
    the call returned it.

    Nesting: the outermost decorated call is the unit of recomputation. A
    decorated call inside it (a decorated sublayer, or `super().call(...)`
    reaching a decorated parent `call`) runs plainly, so nothing is recomputed
    twice. A functional model can be made one unit by decorating an instance's
    bound call (`block.call = recompute_grad(block.call)`); Keras masks its
    outputs carry are kept. That decoration belongs to the instance and is not
    saved: after `load_model`, decorate the loaded block's call again
    (`block = model.get_layer(name); block.call = recompute_grad(block.call)`).

    Distribution: under `tf.distribute.MirroredStrategy` and
    `MultiWorkerMirroredStrategy` (model built in `strategy.scope()`), each
    replica recomputes its own blocks in its backward pass, in custom loops
    (`strategy.run` in `tf.function`) and in `model.fit`: its gradients equal
    those without recomputation; the state it replays is its own copy (Keras 3
    seeds and moving statistics, tf_keras `tf.random.Generator`s, whose
    per-replica streams are kept), left as its forward pass leaves it; a
    variable with `SUM`/`MEAN`/`ONLY_FIRST_REPLICA` aggregation updated in the
    call reads back the combined value, as in the forward pass. A replica
    saves what one device saves (`benchmarks.recompute_distribute`: 19.9 ->
    3.9 MiB per sample per replica at 6 blocks, 38.5 -> 4.3 at 12).
    `recompute_scope` reaches the strategy's replica threads (see
    `recompute_scope`). Tested on both Keras families with 2 replicas on
    logical CPU devices and with 2 worker processes. Not covered, upstream:
    `jit_compile=True` under these strategies on CPU, Keras 3's `fit` under
    `MultiWorkerMirroredStrategy` (keras-team/keras#20585), and unseeded
    `keras.random` calls inside `strategy.run` (Keras creates its global
    `SeedGenerator` per thread, inside the traced function).

    A tape the call opens itself (forces as -dE/dx of an energy) records as
    usual in `tf.function` and `model.fit`: values and gradients (second order
    through that tape) are those of the undecorated layer. In eager mode it
    could record nothing in the forward pass (TensorFlow can only pause every
    tape of a thread), so such a call raises `NotImplementedError` there: run
    the step in a `tf.function` or `model.fit`, or with RECOMPUTE=0. (Found by
    reading the code of the call, of methods and module functions it names
    and of its sublayers' calls for `GradientTape`.)

    Limitations: variables must exist before the recomputation (sublayers are
    built by the forward pass, which always runs first), so sublayers with
    variables or random state -- a `Dropout` with Keras 3 or tf_keras's
    replayable RNG -- are created in `__init__`/`build`, not inside `call`
    (`VariableCreatedInRecomputationError` otherwise); a call inside a
    `tf.while_loop` body in a graph -- an RNN cell with `unroll=False` under
    `tf.function` or `fit` -- raises `NotImplementedError` (decorate the RNN
    layer's `call`, or use `unroll=True`); forward-mode autodiff
    (`tf.autodiff.ForwardAccumulator`) is not supported; tf_keras's default
    legacy random ops cannot be replayed -- see the warning they raise (under a
    strategy too: each replica's recomputation sees its forward pass's masks).

    Args:
        call: the `call` method of a `keras.layers.Layer` or `tf_keras.layers.Layer`
            subclass (a function defined in the class body), or a bound `call`
            of a layer instance.

    Returns:
        The decorated method.

    Raises:
        TypeError: if `call` is not a function or method named `call`, is not
            an instance method taking `self` first (a `@staticmethod`, a plain
            function), or is bound to something that is not a Keras layer.
    """
    if isinstance(call, type) or not callable(call) or not (
        inspect.isfunction(call) or inspect.ismethod(call)
    ):
        raise TypeError(
            "`recompute_grad` decorates the `call` method of a Keras layer "
            f"(a function). Received: {_describe(call)}"
        )
    fn_name = getattr(call, "__name__", None)
    if fn_name != "call":
        raise TypeError(
            "`recompute_grad` decorates the `call` method of a Keras layer, "
            f"but received a function named {fn_name!r}. Decorate `call` itself "
            "(Keras invokes `call` from `Layer.__call__`)."
        )
    bound_to = call.__self__ if inspect.ismethod(call) else None
    unbound = call.__func__ if inspect.ismethod(call) else call
    if bound_to is None:
        _check_takes_self(call)
        _backends.check_decoration(call)
    elif _backends.adapter_for(bound_to) is None:
        raise TypeError(
            "`recompute_grad` decorates the `call` method of a Keras layer "
            "(`keras.layers.Layer` or `tf_keras.layers.Layer`). "
            f"Received: the bound `call` of {_describe(bound_to)}"
        )
    else:
        _backends.adapter_for(bound_to).check_supported(bound_to)

    @tf.autograph.experimental.do_not_convert
    def run(layer, args, kwargs, autograph_status):
        adapter = _backends.adapter_for(layer)
        if adapter is None:
            raise TypeError(
                "`recompute_grad` decorates the `call` method of a Keras layer "
                "(`keras.layers.Layer` or `tf_keras.layers.Layer`). "
                f"Received: a call on {_describe(layer)}"
            )
        fn = _autographed(unbound, autograph_status)
        if not _config.is_enabled():
            return fn(layer, *args, **kwargs)
        adapter.check_supported(layer)
        if not _tf.tape_is_active() or _core.inside_recomputed_call():
            return fn(layer, *args, **kwargs)
        return _core.recomputed_call(adapter, fn, layer, args, kwargs)

    # The wrappers are two lines so that AutoGraph, which converts them when it
    # converts the caller, passes its status on; `run` is never converted.
    if bound_to is not None:

        def bound_wrapper(*args, **kwargs):
            return run(bound_to, args, kwargs, tf.__internal__.autograph.control_status_ctx())

        wrapper = bound_wrapper
    else:

        def wrapper(self, *args, **kwargs):
            return run(self, args, kwargs, tf.__internal__.autograph.control_status_ctx())

    functools.update_wrapper(wrapper, call)
    # The signature of `call` stays visible: tf_keras passes `training` and
    # `mask` only to a `call` that declares them, Keras 3 reads it too.
    wrapper.__signature__ = inspect.signature(call)
    wrapper.__recompute_grad_wrapped__ = unbound
    return wrapper
