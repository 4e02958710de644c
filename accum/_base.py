"""`AccumOptimizer`: the public class, which picks the implementation for the wrapped optimizer."""

import copy

from . import _backends


class AccumOptimizer:
    """Gradient accumulation: batch `b` that trains like batch `k * b`.

    ```python
    from accum import AccumOptimizer

    optimizer = AccumOptimizer(keras.optimizers.Adam(1e-4), steps_per_update=8)
    model.compile(optimizer=optimizer, loss=...)
    model.fit(x, y, batch_size=4)              # trains like batch_size=32
    ```

    `AccumOptimizer(optimizer, k)` wraps a Keras 3 optimizer (TensorFlow
    backend), a tf_keras optimizer or a tf_keras legacy optimizer
    (`tf_keras.optimizers.legacy.*`) and returns an optimizer of the same
    family, usable in `model.compile`, `model.fit` and custom loops
    (`apply_gradients`). Like Keras's `LossScaleOptimizer`, it exposes
    `inner_optimizer` and delegates `learning_rate` (so LR callbacks keep
    working).

    Semantics (`mode="buffer"`, the default): each call to `apply_gradients`
    is one *micro-step*. The gradients are summed into one buffer per
    variable; the weights change only on every `k`-th micro-step, when the
    inner optimizer is applied once to the mean of the `k` gradients. Everything
    that counts updates counts windows: the inner optimizer's `iterations`,
    learning-rate schedules, Adam's bias correction, weight decay, clipping
    (`clipnorm`, `global_clipnorm` and `clipvalue` act on the mean) and EMA.
    With a loss that is a mean over the micro-batch, the result equals the
    inner optimizer trained on batches of `k * b` samples (up to float
    rounding: <= 1e-6 in float32, <= 1e-12 in float64).

    - `iterations` counts applied updates (it is the inner optimizer's);
      `micro_steps` counts calls to `apply_gradients`.
    - `tf.IndexedSlices` gradients (embeddings) are scatter-added into the
      buffer: no full-size dense tensor is built per micro-step.
    - A micro-batch with a non-finite gradient (mixed precision overflow) is
      skipped: it is not added, and the mean divides by the micro-batches kept.
      A window with none kept applies no update. With Keras's
      `LossScaleOptimizer` outside (`LossScaleOptimizer(AccumOptimizer(...))`,
      what `model.compile` builds under `mixed_float16`), the loss scale
      reacts to every micro-step and skipped micro-batches never reach the
      buffer.
    - Windows are counted in micro-steps and run across epoch boundaries by
      default: micro-batches left over at the end of an epoch are carried into
      the next window, never dropped. At the end of `fit` a pending partial
      window is reported once with a warning. `flush()` applies a partial
      window now (normalized by the micro-batches it holds), and
      `flush_callback(at="epoch_end" | "train_end")` does so from `fit`.
    - State (buffers, counters) is saved with the optimizer (`.keras` files,
      `tf.train.Checkpoint`), so resuming mid-window is bit-exact. The `.keras`
      state is stored by name, so a different `k` at load time keeps the
      inner optimizer's slots.
    - BatchNormalization cannot be accumulated (each micro-batch is normalized
      with its own statistics): a warning is issued when the optimizer is built
      for a model that contains one.

    `mode="momentum"`: accumulation with no extra buffer, for SGD with
    momentum (exact) and Adam/AdamW (approximate). See `accum.momentum_mode`
    for the derivation and its limits.

    Args:
        optimizer: the optimizer to wrap (Keras 3, tf_keras or tf_keras legacy).
            Not an `AccumOptimizer`.
        steps_per_update: `k`, an integer >= 1: micro-steps per update.
            `k=1` behaves exactly like `optimizer`.
        mode: `"buffer"` (default, exact for every optimizer) or `"momentum"`.
        name: optional name of the wrapper.
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        if cls is AccumOptimizer:
            cls = _backends.implementation_for(check_optimizer(optimizer))
        return super().__new__(cls)

    @property
    def micro_steps(self):
        """Micro-steps so far: the number of `apply_gradients` calls (a variable)."""
        return self._micro_steps_variable()

    def flush_callback(self, at="epoch_end"):
        """Returns a callback for `fit` that calls `flush()` at every epoch end or at train end.

        Args:
            at: `"epoch_end"` (each epoch ends with an update, windows never
                span epochs) or `"train_end"` (only the last partial window of
                `fit` is applied).
        """
        from ._flush import make_flush_callback

        return make_flush_callback(self, at)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates an `AccumOptimizer` from `get_config()` output (inner optimizer nested)."""
        if cls is AccumOptimizer:
            family = config.get("family", _backends.KERAS3)
            cls = _backends.implementation_for(family)
        return cls._from_config(copy.deepcopy(config), custom_objects)


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
    family = _backends.family_of(optimizer)
    if family is None:
        raise ValueError(
            "`optimizer` must be a Keras 3 or tf_keras optimizer instance "
            "(e.g. `keras.optimizers.Adam()`). "
            f"Received: optimizer={optimizer!r} of type {type(optimizer).__name__}"
        )
    return family
