"""`recompute_grad`: the public decorator."""

import functools
import inspect
import weakref

import tensorflow as tf

from .ops import _attention
from .adapters import _backends, _tf
from . import _config
from ._errors import offload_refused
from . import engine as engines
from .policies import _registry


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
    return _tf.autograph_convert(fn, status)


def _checked_call(call):
    """(the layer `call` is bound to or None, the function behind it), or a TypeError
    unless `call` is a Keras layer's `call` (a function, or bound to a layer)."""
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
    return bound_to, unbound


def _check_offload(offload, policy):
    """`offload` as a bool: a TypeError if it is not one, a ValueError if it is True under a
    policy other than "full" (only a whole call's inputs are offloaded)."""
    if not isinstance(offload, bool):
        raise TypeError(f"`offload` is True or False. Received: offload={offload!r}")
    if offload and policy != "full":
        raise ValueError(offload_refused(policy))
    return offload


def recompute_grad(call=None, *, policy="full", offload=False):
    """Decorates a Keras layer's `call` so that its activations are recomputed in the backward pass.

    ```python
    class Block(keras.layers.Layer):
        @recompute_grad                      # or @recompute_grad(policy="attention")
        def call(self, x, training=None, mask=None):
            ...
    ```

    With `RECOMPUTE=1` (read each time the layer runs) or inside
    `recompute_scope(True)`, and while a `tf.GradientTape` records, the
    forward pass keeps less and the backward pass recomputes the rest:
    `policy="full"`, the whole call (it keeps only its inputs);
    `policy="attention"`, only the attention core (scores, mask, softmax,
    dropout) of the `MultiHeadAttention` layers the layer contains. Nothing
    else changes: the loss and every gradient equal the undecorated layer's
    (`None` where it has `None`), dropout included -- random state is replayed
    -- and side effects (moving statistics, metrics, `add_loss`) happen once.
    Off, or with no tape recording, `call` runs as written. Keras 3
    (TensorFlow backend) and tf_keras; eager, `tf.function`, `jit_compile`,
    `fit`, mixed precision, `tf.distribute`. On Keras 3's JAX backend the
    call becomes a `jax.checkpoint` with its state threaded through
    (`recompute.engine._jax`, docs/jax.md): `fit`, `stateless_call` under `jax.grad`. The outermost decorated call is
    the unit; a functional block: `block.call = recompute_grad(block.call)`.

    Limits: sublayers with variables or random state must exist before the
    recomputation; in eager mode a call that opens its own `GradientTape` is
    refused; so is a call inside a `tf.while_loop` body; no forward-mode
    autodiff; tf_keras's legacy RNG gives exact gradients but other masks
    than RECOMPUTE=0 (a warning says so). In full: docs/recompute.md.

    Args:
        call: the `call` of a `keras.layers.Layer` or `tf_keras.layers.Layer`
            subclass (first parameter `self`), or a layer instance's bound `call`.
        policy: "full" (default) or "attention" (keyword only).
        offload: on Keras 3's JAX backend, with `policy="full"`, keep the call's
            inputs in pinned host memory from the forward to the backward pass
            instead of the accelerator's (keyword only; default False). Exact like
            every policy. It pays at depth and at large batches, not everywhere: at
            keras-hub BERT-base XLA:GPU plans less device memory with it at batches 8
            and 32, more at 2 and 4 (`benchmarks.gpu_plan --offload` shows a model's
            plan). On a CPU, host memory is the
            device's: nothing to offload to, the same gradients. TensorFlow has no host offload: True raises
            there (docs/recompute.md, "Host offload"). Under `"full"` a Keras 3 block of
            Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers also
            runs its batch in cuts, on JAX with or without offload, and on TensorFlow
            (`recompute.batch_cut`).

    Returns:
        The decorated method (a decorator if `call` is omitted).

    Raises:
        TypeError: `call` is not a layer's `call`; `offload` is not a bool.
        ValueError: an unknown `policy`; `offload=True` with `policy="attention"`;
            `offload=True` on TensorFlow, at a recomputed call; at the layer's first call, RECOMPUTE
            on or off, policy="attention" on a layer without
            `MultiHeadAttention` layers.
        NotImplementedError: a Keras 3 backend other than TensorFlow and JAX.
    """
    if isinstance(call, str):
        raise TypeError(
            "`recompute_grad` takes the policy as a keyword argument: "
            f"`@recompute_grad(policy={call!r})`. Received: recompute_grad({call!r})"
        )
    _registry.check_policy(policy)
    offload = _check_offload(offload, policy)
    if call is None:
        return functools.partial(recompute_grad, policy=policy, offload=offload)
    run_policy = _registry.POLICIES[policy]
    bound_to, unbound = _checked_call(call)

    # Layers that passed the policy's check (policy="attention": it has MultiHeadAttention
    # layers), made at each layer's first call whether RECOMPUTE is on or off: at the
    # decoration the layer does not exist yet, or has not built its sublayers.
    checked = weakref.WeakSet()

    @tf.autograph.experimental.do_not_convert
    def run(layer, args, kwargs, autograph_status):
        adapter = _backends.adapter_for(layer)
        if adapter is None:
            raise TypeError(
                "`recompute_grad` decorates the `call` method of a Keras layer "
                "(`keras.layers.Layer` or `tf_keras.layers.Layer`). "
                f"Received: a call on {_describe(layer)}"
            )
        if policy == "attention" and layer not in checked:
            _attention.attention_layers(adapter, layer)
            checked.add(layer)
        if not _config.is_enabled():
            return _autographed(unbound, autograph_status)(layer, *args, **kwargs)
        adapter.check_supported(layer)
        engine = engines.of(adapter)
        fn = _autographed(unbound, autograph_status)  # as it is, on JAX (TensorFlow is eager)
        if not engine.recomputes():
            return fn(layer, *args, **kwargs)
        return engine.run(run_policy, fn, layer, args, kwargs, offload=offload)

    # The wrappers are two lines so that AutoGraph, which converts them when it
    # converts the caller, passes its status on; `run` is never converted.
    if bound_to is not None:

        def bound_wrapper(*args, **kwargs):
            return run(bound_to, args, kwargs, _tf.autograph_status())

        wrapper = bound_wrapper
    else:

        def wrapper(self, *args, **kwargs):
            return run(self, args, kwargs, _tf.autograph_status())

    functools.update_wrapper(wrapper, call)
    # The signature of `call` stays visible: tf_keras passes `training` and
    # `mask` only to a `call` that declares them, Keras 3 reads it too.
    wrapper.__signature__ = inspect.signature(call)
    wrapper.__recompute_grad_wrapped__ = unbound
    return wrapper
