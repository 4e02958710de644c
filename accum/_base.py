"""`AccumOptimizer`: the public class, which picks the implementation for the wrapped optimizer;
`WrapperOps`: the part of a family's `accum.modes._family.Family` that every family
reads off its wrapper alike."""

import copy
import inspect
import warnings
import weakref

import numpy as np
import tensorflow as tf

from .modes import _distributed, _family, _modes, _rescale
from . import _families, _validation


class WrapperOps(_family.Family):
    """The `accum.modes._family.Family` operations every family reads off its wrapper the
    same way; each family's subclass (its `AccumOptimizer._OPS`) adds the rest.

    Built by the wrapper's `_init_window`, once its `k` and rule are set; `strategy` is
    set by `_begin_build`.
    """

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.steps_per_update, self.rule = wrapper.steps_per_update, wrapper._rule

    def finish_batch_norm(self, when=True, reduce=None):
        self.wrapper._finish_batch_norm(when, reduce)

    def rescale_state(self):
        wrapper = self.wrapper
        return _rescale.Step(self.rule, wrapper.inner_optimizer, list(wrapper._model_variables_list()),
                             wrapper._micro_steps_variable(), wrapper.window_steps, wrapper._finish_batch_norm)


class AccumOptimizer:
    """Gradient accumulation: batch `b` that trains exactly like batch `k * b`.

    ```python
    optimizer = AccumOptimizer(keras.optimizers.Adam(1e-4), steps_per_update=8)
    model.compile(optimizer=optimizer, loss=...)
    model.fit(x, y, batch_size=4)              # trains like batch_size=32
    ```

    Wraps a Keras 3 (TensorFlow or JAX backend), tf_keras or tf_keras legacy
    optimizer and is an optimizer of the same family (`compile`, `fit`,
    custom loops, `tf.distribute`; on JAX, Keras's trainer and
    `stateless_apply`), with `inner_optimizer`, a delegated
    `learning_rate` and a nested config, like `LossScaleOptimizer`. Each
    `apply_gradients` call is a micro-step; every `k`-th applies the inner
    optimizer once to the mean gradient, so everything that counts updates
    (`iterations`, LR schedules, bias correction, weight decay, clipping, EMA)
    counts windows. `micro_steps` counts micro-steps. A variable missing from a
    micro-step counts a zero gradient there; one missing from the whole window
    is not updated. Non-finite micro-batches are skipped (`mode="rescale"`:
    counted as zero gradients). The window's state is
    saved with the model: resuming mid-window is bit-exact. Compiling the model
    with another optimizer while micro-steps are pending warns (they are dropped).

    Limits: `mode="momentum"` is exact for SGD with momentum only (Adam's
    second moment is approximate) and refuses other optimizers, `flush()`,
    `tf.distribute` and the JAX backend; `mode="rescale"` is approximate (exact
    for `k=1`), refuses optimizers with no moving average (Adagrad, Ftrl, SGD
    without momentum, ...), a `k` too large for a coefficient `β̃` to keep its
    precision in the variables' dtype (float32: `k <= 0.01 * (1 - β) * 2**25`,
    e.g. 335 for `beta_2=0.999`), `tf.distribute` and `flush()`, and warns where
    only the window's last micro-gradient moves the weights (RMSprop without
    momentum, Adadelta, Adafactor); Keras's BatchNormalization keeps per-micro-batch moving
    statistics (a warning points to `accum.BatchNormalization`, whose moving
    statistics are the big batch's); with tf_keras, put its
    `LossScaleOptimizer` inside the wrapper. Semantics, saving and limits in
    full: docs/accumulation.md; distribution: `accum.modes._distributed`; the
    derivations: `accum.modes._momentum`, `accum.modes._rescale`.

    Args:
        optimizer: the optimizer to wrap. Not an `AccumOptimizer`, not one with
            Keras's `gradient_accumulation_steps`, not one another live
            `AccumOptimizer` wraps.
        steps_per_update: `k`, an integer from 1 to `2**63 - 1` (read-only;
            on JAX without `jax_enable_x64`, where the counters are int32, up to
            `2**31 - 1`); `k=1` behaves exactly like `optimizer`.
        mode: `"buffer"` (default; exact for every optimizer), `"momentum"`
            (no buffers; SGD/Adam/AdamW) or `"rescale"` (no buffers; every
            optimizer with moving averages: `β̃ = 1 − (1 − β)/k`, weights
            moved at every `k`-th micro-step; see `accum.modes._rescale`).
        name: optional name of the wrapper.
    """

    # `accum._dispatch.implementation_for(family)`, linked by `accum/__init__`
    # (`accum._dispatch.link`): the dispatch lives above the family implementations,
    # which import this module.
    _implementation_for = None
    _implementation_class = None  # `accum._dispatch.implementation_class`
    _OPS = WrapperOps  # the family's `accum.modes._family.Family` (a `WrapperOps` subclass)

    def __new__(cls, *args, **kwargs):
        # `AccumOptimizer(...)` builds the subclass for the optimizer's family.
        # `optimizer` is checked here, once (the subclass's `__init__` checks the
        # other arguments). (Permissive arguments: `copy`/`pickle` call
        # `__new__(cls)` alone, which checks nothing on a subclass; the public
        # signature is `__signature__` below.)
        given = args or "optimizer" in kwargs
        if cls is AccumOptimizer or given:
            optimizer = kwargs["optimizer"] if "optimizer" in kwargs else (args[0] if args else None)
            family = check_optimizer(optimizer)
            if cls is AccumOptimizer:
                cls = AccumOptimizer._implementation_for(family)
            elif family != cls._FAMILY:
                raise ValueError(
                    f"This `AccumOptimizer` class wraps {cls._FAMILY_DESCRIPTION} optimizers; "
                    "build it with `accum.AccumOptimizer(optimizer, steps_per_update)`. "
                    f"Received: optimizer={optimizer!r}"
                )
            else:  # a class named by a saved config: the one for this Keras 3 backend
                cls = AccumOptimizer._implementation_class(cls)
        return super().__new__(cls)

    def _check_arguments(self, steps_per_update, mode):
        """`steps_per_update` and `mode` validated (`optimizer` is checked in `__new__`)."""
        return _validation.check_steps_per_update(steps_per_update), _validation.check_mode(mode)

    def _checked(self, optimizer, steps_per_update, mode, kwargs):
        """The constructor's arguments validated, with the mode's rule for `optimizer`
        (`_mode_rule`): `(steps_per_update, mode, rule)`; keyword arguments left in
        `kwargs` are refused (`_check_kwargs`)."""
        steps_per_update, mode = self._check_arguments(steps_per_update, mode)
        self._check_kwargs(kwargs)
        return steps_per_update, mode, self._mode_rule(optimizer, mode, steps_per_update)

    def _check_kwargs(self, kwargs):
        if kwargs:
            raise ValueError(
                f"AccumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. "
                "Set them on the inner optimizer."
            )

    def _mode_rule(self, optimizer, mode, steps_per_update):
        """What the mode needs of `optimizer`, refusing those it cannot handle: the
        family's `MomentumRule` (`mode="momentum"`), its `accum.modes._rescale.Rescale`
        (`mode="rescale"`), or None (`mode="buffer"`); see `accum.modes._modes`."""
        return _modes.MODES[mode].rule(self._OPS, optimizer, steps_per_update)

    def _init_window(self, steps_per_update, mode, rule):
        """Sets the validated arguments (after the Keras optimizer's `__init__`)."""
        self._steps_per_update = steps_per_update
        self.mode = mode  # the name, as given and saved
        self._mode = _modes.MODES[mode]  # what the mode does (`accum.modes._modes`)
        self._rule = rule
        self._warned_pending = False
        self._ops = self._OPS(self)  # what the modes ask of this family (`accum.modes._family`)

    def _select_steps(self):
        """The steps a micro-step runs (`accum.modes._modes.step_for`), selected at the end of
        `build` (once the family's window is built): `_step` outside a replica context,
        `_local_step` in one (under a strategy)."""
        mode, k = self._mode, self._steps_per_update
        self._step = _modes.step_for(mode, k, False, self._ops)
        self._local_step = _modes.step_for(mode, k, True, self._ops)

    @property
    def iterations(self):
        """Applied updates: the inner optimizer's `iterations`."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (settable, for LR callbacks)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def steps_per_update(self):
        """`k`: micro-steps per update. Read-only (compiled train steps read it once, when traced)."""
        return self._steps_per_update

    @steps_per_update.setter
    def steps_per_update(self, value):
        raise AttributeError(
            "`steps_per_update` is read-only: a compiled train step (`fit`, "
            "`tf.function`) reads it once, when it is traced, so a new value would "
            "be reported by `get_config()` but not used. To change it, build a new "
            "`AccumOptimizer` (e.g. `AccumOptimizer.from_config(config)` with the "
            "new `steps_per_update`, or around a new inner optimizer) and compile "
            f"the model again. Received: steps_per_update={value!r}"
        )

    @property
    def micro_steps(self):
        """Micro-steps so far: the number of `apply_gradients` calls (a variable)."""
        return self._micro_steps_variable()

    def flush_callback(self, at="epoch_end"):
        """Returns a callback for `fit` that calls `flush()` at every epoch end or at train end.

        `mode="buffer"` only, as `flush()` (a `ValueError` otherwise, here).

        Args:
            at: `"epoch_end"` (each epoch ends with an update, windows never
                span epochs) or `"train_end"` (only the last partial window of
                `fit` is applied).
        """
        from ._flush import make_flush_callback

        self._check_flushable()
        return make_flush_callback(self, at)

    def _begin_build(self, var_list):
        """What every family's `build` starts with (once): the `tf.distribute` strategy, if
        any (the window is then replica-local, `accum.modes._distributed`), refusing a mode
        that cannot be distributed, and variables the mode cannot update."""
        self._accum_strategy = self._ops.strategy = _distributed.current_strategy()
        if self._accum_strategy is not None:
            self._mode.check_distributable()
        self._mode.check_variables(self._ops, var_list)

    # ------------------------------------------------- accum.BatchNormalization

    def _link_batch_norm(self, var_list):
        """Links the `accum.BatchNormalization` layers this optimizer trains (at `build`)."""
        from .batchnorm._layer import layers_trained_by

        layers = layers_trained_by(var_list)
        if layers and self._FAMILY == _families.KERAS3:
            import keras

            if keras.backend.backend() != "tensorflow":
                raise NotImplementedError(
                    "`accum.BatchNormalization` updates its window statistics on the "
                    "TensorFlow backend only. Received: the layer(s) "
                    f"{[layer.name for layer in layers]} trained on the "
                    f"{keras.backend.backend()!r} backend; use "
                    "`keras.layers.BatchNormalization` there (statistics per micro-batch)."
                )
        for layer in layers:
            layer._link(self)
        # A legacy optimizer is built again for variables that became trainable: keep the
        # first. One list, extended in place (the Keras 3 window holds it).
        if getattr(self, "_batch_norm_layers", None) is None:
            self._batch_norm_layers = []
        linked = self._batch_norm_layers
        linked.extend([l for l in layers if all(l is not p for p in linked)])

    def _links_batch_norm(self, layer):
        """Whether this optimizer links the `accum.BatchNormalization` `layer` (finishes its
        windows); None while not built."""
        layers = getattr(self, "_batch_norm_layers", None)
        return None if layers is None else any(l is layer for l in layers)

    def _finish_batch_norm(self, when=True, reduce=None):
        """The window's end for the linked `accum.BatchNormalization` layers (`reduce`: see
        `accum.batchnorm._layer.finish_windows`)."""
        from .batchnorm._layer import finish_windows

        finish_windows(getattr(self, "_batch_norm_layers", ()), when, reduce)

    def flush(self):
        """Applies the pending partial window now, normalized by the micro-batches it holds.

        Does nothing if the window is empty or the optimizer is not built. The
        variables updated are those that got a gradient in some micro-step of
        the window. Works eagerly and inside `tf.function` (JAX: eagerly between
        `fit` calls, or inside a traced function that maps the optimizer's variables,
        `stateless_apply`-style). `mode="buffer"`
        only (a `ValueError` otherwise): with `mode="momentum"` the pending
        micro-gradients are already folded into the moments, scaled by `1/k`,
        and cannot be normalized by their count; with `mode="rescale"` they are
        in the moving averages and move the weights at the next update.
        """
        self._check_flushable()
        if not self._has_window_state():
            return
        local = getattr(self, "_accum_strategy", None) is not None  # the window is replica-local
        (self._local_step if local else self._step).flush(self._ops)

    def _check_flushable(self):
        self._mode.check_flushable(self.steps_per_update)

    def _pending_micro_steps(self):
        """Micro-steps in the current window (0 if not built yet, or not eager)."""
        if not self._has_window_state() or not tf.executing_eagerly():
            return 0
        return int(self.window_steps.numpy())

    def _guard_recompile(self):
        """Makes `compile` of the model being trained warn about dropped micro-steps
        (`accum._recompile`; from `build` and the end of `fit`)."""
        from ._recompile import guard_training_model

        guard_training_model(self)

    def _warn_pending(self):
        """Warns once (per optimizer) about micro-steps pending at the end of `fit`
        (called by `finalize_variable_values`)."""
        self._guard_recompile()
        if self._warned_pending:
            return
        pending = self._pending_micro_steps()
        if not pending:
            return
        self._warned_pending = True
        window, fate = self._mode.pending(self.steps_per_update)
        warnings.warn(
            f"AccumOptimizer: {pending} micro-step(s) of an incomplete window ({window}) "
            f"are pending at the end of training. {fate}",
            stacklevel=3,
        )

    # ------------------------------------------------------ saved state
    # Keras saves an optimizer's variables by position; the inner optimizer
    # saves its own slots that way. The wrapper's counters are saved by name
    # and its buffers by position in the variable list the optimizer was
    # built with (the model's trainable variables, the order Keras itself
    # uses), never by variable name: names such as `sequential_1/dense_2`
    # change between processes. So a different `k` (or wrapper) at load time
    # keeps the inner optimizer's slots.

    def _has_window_state(self):
        """Whether the window counters and buffers exist yet (overridden per family)."""
        return True

    def _checkpoint_buffers(self):
        """The buffers as checkpoints hold them: each with `shape`, `dtype`, `numpy()` and
        `assign(value)` (overridden where a buffer has one row per device)."""
        return self.accumulators

    def _own_state(self):
        """(key, variable) pairs of the wrapper's counters, then its buffers (`accumulator:<i>`)."""
        pairs = [("micro_steps", self._micro_steps_variable())]
        if not self._has_window_state():
            return pairs
        pairs += [("window_steps", self.window_steps), ("window_count", self.window_count)]
        pairs += [(f"accumulator:{i}", acc) for i, acc in enumerate(self._checkpoint_buffers())]
        # The touched flags (`accum.modes._window`), by the position of their variable too.
        pairs += [(f"touched:{i}", flag) for i, flag in enumerate(getattr(self, "touched", []))]
        return pairs

    def save_own_variables(self, store):
        """Saves counters by name and buffers by position (the inner optimizer saves its own slots)."""
        for key, variable in self._own_state():
            store[key] = variable.numpy()

    def load_own_variables(self, store):
        """Restores counters and buffers.

        Raises a `ValueError` if the saved buffers do not match this
        optimizer's (number or shapes) while a window is pending;
        warns if window state is saved but this optimizer is not built yet (as
        Keras does for the inner optimizer's slots).
        """
        keys = set(store.keys())
        state = dict(self._own_state())
        if "micro_steps" in keys:
            state["micro_steps"].assign(store["micro_steps"])
        if "window_steps" not in keys:
            return  # saved before the optimizer was built: no window yet
        if not self._has_window_state():
            warnings.warn(
                f"AccumOptimizer: skipping the saved window ({int(np.asarray(store['window_steps']))} "
                f"pending micro-step(s), counters and accumulation buffers) of "
                f"optimizer '{self._config_name()}', "
                "because it is not built yet. Call "
                "`optimizer.build(model.trainable_variables)` before loading to "
                "resume the pending window.",
                stacklevel=2,
            )
            return
        values = self._saved_buffers(store, keys)
        state["window_steps"].assign(store["window_steps"])
        state["window_count"].assign(store["window_count"])
        for acc, value in zip(self._checkpoint_buffers(), values):
            acc.assign(value)
        flags = getattr(self, "touched", [])
        saved_flags = [store[f"touched:{i}"] for i in range(len(flags)) if f"touched:{i}" in keys]
        if len(saved_flags) == len(flags) and all(
            tuple(np.shape(v)) == tuple(f.shape) for v, f in zip(saved_flags, flags)
        ):
            for flag, value in zip(flags, saved_flags):
                flag.assign(value)
        else:
            # No flags saved (or not matching): a variable with buffered gradient
            # counts as touched; with no window pending, none is.
            for flag, acc in zip(flags, self._checkpoint_buffers()):
                flag.assign(tf.cast(tf.reduce_any(tf.not_equal(acc, 0)), flag.dtype))

    def _saved_buffers(self, store, keys):
        """The buffers saved in `store` (by position), checked against this optimizer's:
        zeros if they do not match while no micro-step is pending, else a `ValueError`."""
        saved = sorted(
            int(key.split(":", 1)[1])
            for key in keys
            if key.startswith("accumulator:") and key.split(":", 1)[1].isdigit()
        )
        values = [store[f"accumulator:{i}"] for i in saved]
        received = [tuple(np.shape(v)) for v in values]
        expected = [tuple(acc.shape) for acc in self._checkpoint_buffers()]
        if saved != list(range(len(saved))) or received != expected:
            if int(np.asarray(store["window_steps"])) == 0:
                # No micro-step pending (saved buffers are zero): nothing is lost,
                # e.g. saved with mode="buffer" between windows, loaded with "momentum".
                values = [
                    np.zeros(shape, getattr(acc.dtype, "as_numpy_dtype", acc.dtype))
                    for shape, acc in zip(expected, self._checkpoint_buffers())
                ]
            else:
                by_name = sorted(
                    k for k in keys if k.startswith("accumulator:") and not k.split(":", 1)[1].isdigit()
                )
                raise ValueError(
                    "AccumOptimizer: the saved accumulation buffers do not match this "
                    f"optimizer's variables. Expected: {len(expected)} buffer(s) (one per "
                    f"trainable variable, mode={self.mode!r}) with shapes {expected}. "
                    f"Received: {len(received)} buffer(s) with shapes {received}"
                    + (f" and buffers keyed by name {by_name} (written by an older "
                       "version of accum; not supported)" if by_name else "")
                    + ". Load into a model with the same trainable variables (same "
                    "architecture, same layers trainable), built before loading."
                )
        return values

    # ------------------------------------------------------------- config
    # Each family provides `_FAMILY`, `_serialize_inner()` and
    # `_deserialize_inner(config, custom_objects)`.

    def get_config(self):
        """The wrapper's config, with the inner optimizer's nested under `inner_optimizer`."""
        return {
            "name": self._config_name(),
            "inner_optimizer": self._serialize_inner(),
            "steps_per_update": self.steps_per_update,
            "mode": self.mode,
            "family": self._FAMILY,
        }

    def _config_name(self):
        return self.name

    @classmethod
    def _from_config(cls, config, custom_objects=None):
        config.pop("family", None)
        inner = config.pop("inner_optimizer")
        if isinstance(inner, dict):
            inner = cls._deserialize_inner(inner, custom_objects)
        return cls(inner, **config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates an `AccumOptimizer` from `get_config()` output (inner optimizer nested)."""
        if cls is AccumOptimizer:
            family = config.get("family", _families.KERAS3)
            cls = AccumOptimizer._implementation_for(family)
        return cls._from_config(copy.deepcopy(config), custom_objects)


AccumOptimizer.__signature__ = inspect.Signature(
    [
        inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("steps_per_update", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("mode", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="buffer"),
        inspect.Parameter("name", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
)


# inner optimizer -> weak reference to the `AccumOptimizer` that wraps it.
_OWNERS = weakref.WeakKeyDictionary()


def claim_inner(wrapper, optimizer):
    """Records that `wrapper` owns `optimizer` (and the optimizers it wraps), or raises
    a `ValueError` if another live `AccumOptimizer` already does: both would advance
    the same `iterations` and slots, each with its own window."""
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    for inner in chain:
        ref = _OWNERS.get(inner)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not wrapper:
            raise ValueError(
                "`optimizer` is already wrapped by another `AccumOptimizer` "
                f"({getattr(owner, '_name', None) or owner.name!r}); two wrappers would both update its iterations "
                "and slots, each with its own window. Give each `AccumOptimizer` "
                "its own inner optimizer (e.g. `optimizer.__class__.from_config("
                f"optimizer.get_config())`). Received: optimizer={chain[0]!r}"
            )
    for inner in chain:
        _OWNERS[inner] = weakref.ref(wrapper)


def check_optimizer(optimizer):
    """Returns the family of `optimizer`, or raises a Keras-style `ValueError`."""
    if isinstance(optimizer, AccumOptimizer):
        raise ValueError(
            "`optimizer` is already an `AccumOptimizer`; wrap the inner optimizer "
            "once, with the total `steps_per_update`. "
            f"Received: optimizer={optimizer!r}"
        )
    inner = getattr(optimizer, "inner_optimizer", None)
    while inner is not None:
        if isinstance(inner, AccumOptimizer):
            raise ValueError(
                "`optimizer` already wraps an `AccumOptimizer`; accumulation can "
                f"only be applied once. Received: optimizer={optimizer!r}"
            )
        inner = getattr(inner, "inner_optimizer", None)
    inner = optimizer
    while inner is not None:
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "`optimizer` already accumulates gradients "
                f"(gradient_accumulation_steps={steps}); accumulating twice multiplies "
                "the windows and Keras's accumulation does not count updates as "
                "`AccumOptimizer` does. Build the inner optimizer without "
                "`gradient_accumulation_steps` and pass the total number of "
                f"micro-steps per update as `steps_per_update` (e.g. "
                f"`AccumOptimizer(optimizer, steps_per_update={steps})`). "
                f"Received: optimizer={optimizer!r}"
            )
        inner = getattr(inner, "inner_optimizer", None)
    family = _families.family_of(optimizer)
    if family is None:
        raise ValueError(
            "`optimizer` must be a Keras 3 or tf_keras optimizer instance "
            "(e.g. `keras.optimizers.Adam()`). "
            f"Received: optimizer={optimizer!r} of type {type(optimizer).__name__}"
        )
    if family == _families.KERAS3:
        import keras

        backend = keras.backend.backend()
        if backend not in ("tensorflow", "jax"):
            raise NotImplementedError(
                "`AccumOptimizer` supports Keras 3 with the TensorFlow or JAX backend. "
                f"Received: an optimizer of the {backend!r} backend "
                f"({type(optimizer).__name__}). Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax."
            )
    return family
