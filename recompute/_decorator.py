"""`recompute_grad`: the public decorator."""

import functools
import inspect

import tensorflow as tf

from . import _backends, _config, _core, _tf


def _describe(obj):
    return f"{obj!r} of type {type(obj).__name__}"


def _autographed(fn):
    """`fn` converted by AutoGraph when the caller is being converted (as Keras does).

    The wrapper itself is excluded from conversion, so the user's `call` gets
    the conversion a plain `call` would get inside `tf.function`.
    """
    if tf.executing_eagerly():
        return fn
    return tf.__internal__.autograph.tf_convert(
        fn, tf.__internal__.autograph.control_status_ctx()
    )


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
    are those of the undecorated layer -- with dropout on, because the random
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
    once.

    Limitations: variables must exist before the recomputation (sublayers are
    built by the forward pass, which always runs first); forward-mode autodiff
    (`tf.autodiff.ForwardAccumulator`) is not supported; tf_keras's default
    legacy random ops cannot be replayed -- see the warning they raise.

    Args:
        call: the `call` method of a `keras.layers.Layer` or `tf_keras.layers.Layer`
            subclass (a function defined in the class body), or a bound `call`
            of a layer instance.

    Returns:
        The decorated method.

    Raises:
        TypeError: if `call` is not a function or method named `call`.
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

    def run(layer, args, kwargs):
        fn = _autographed(unbound)
        adapter = _backends.adapter_for(layer)
        if adapter is None:
            raise TypeError(
                "`recompute_grad` decorates the `call` method of a Keras layer "
                "(`keras.layers.Layer` or `tf_keras.layers.Layer`). "
                f"Received: a call on {_describe(layer)}"
            )
        if not _config.is_enabled():
            return fn(layer, *args, **kwargs)
        adapter.check_supported(layer)
        if not _tf.tape_is_active():
            return fn(layer, *args, **kwargs)
        return _core.recomputed_call(adapter, fn, layer, args, kwargs)

    if bound_to is not None:
        @functools.wraps(call)
        def bound_wrapper(*args, **kwargs):
            return run(bound_to, args, kwargs)

        return tf.autograph.experimental.do_not_convert(bound_wrapper)

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        return run(self, args, kwargs)

    wrapper.__recompute_grad_wrapped__ = call
    return tf.autograph.experimental.do_not_convert(wrapper)
