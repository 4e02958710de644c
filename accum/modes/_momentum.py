"""`mode="momentum"`: gradient accumulation folded into the inner optimizer's own moment slots.

Derivation. With the mean gradient of a window `g = (1/k) sum_i g_i`, one
update of SGD with momentum and of Adam reads

    SGD:   m <- mu m - lr g                      w <- w + m
    Adam:  m <- b1 m + (1 - b1) g                w <- w - lr_t m / (sqrt(v) + eps)
           v <- b2 v + (1 - b2) g^2              lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)

The moment updates are linear in `g`, so they can be split over the window:
decay the moments once at the window's first (kept) micro-step, add one
`1/k`-scaled contribution per micro-step, and move the weights once, at the
end:

    first micro-step:  m <- mu m          (Adam: m <- b1 m,  v <- b2 v)
    every micro-step:  m <- m - lr g_i / k (Adam: m <- m + (1 - b1) g_i / k,
                                                  v <- v + (1 - b2) g_i^2 / k)
    last micro-step:   weight decay, w <- w + m (Adam: w <- w - lr_t m / (sqrt(v) + eps)),
                       iterations += 1

The learning rate (and its schedule) is read at the update's iteration, which
does not change inside a window. No buffer is needed: the moments are the
buffer. This saves one copy of the parameters (float32: 4 bytes per
parameter, 0.41 GiB for BERT-base's 110M, 1.25 GiB for BERT-large's 335M).

Exactness:
- SGD with momentum (nesterov=False): exact (up to float rounding), since `m`
  is linear in `g`. Nesterov needs both the old and the new momentum at the
  end and is rejected.
- Adam/AdamW: `m` is exact; `v` collects the mean of the squares
  `(1/k) sum_i g_i^2` instead of the square of the mean `g^2`. The mean of
  squares is larger by the variance of the micro-batch gradients, so steps are
  somewhat smaller than at batch `k * b` (approximate: the tests and the
  benchmark measure the deviation).

Limits (all documented, each raises a clear error where it applies): no
clipping (the mean gradient is never formed), no EMA, no amsgrad, no loss
scaling inside (put `LossScaleOptimizer` outside). A skipped non-finite
micro-batch counts as zero gradients: the window is always divided by `k`
(the old moment cannot be told apart from the contributions once they are
summed). For the same reason `flush()` is refused (`AccumOptimizer.flush`):
normalizing a partial window of `c < k` micro-steps by `c` needs the window's
sum apart from the old moment, i.e. a buffer; a partial window is carried
into the next one instead (exact).
"""

import dataclasses

import tensorflow as tf

from . import _window

SGD, ADAM = "sgd", "adam"


def unsupported(optimizer, reason):
    """The Keras-style error for an optimizer `mode="momentum"` cannot fold into."""
    return ValueError(
        '`mode="momentum"` supports SGD with momentum > 0 (nesterov=False) and '
        "Adam/AdamW (amsgrad=False), without gradient clipping, EMA or loss "
        f"scaling on the inner optimizer; {reason}. Use `mode=\"buffer\"` instead. "
        f"Received: optimizer={type(optimizer).__name__}"
    )


def check_common(optimizer):
    """Rejects clipping and EMA, which need the mean gradient or per-update weights."""
    for attribute in ("clipnorm", "global_clipnorm", "clipvalue"):
        if getattr(optimizer, attribute, None):
            raise unsupported(optimizer, f"`{attribute}` is set")
    if getattr(optimizer, "use_ema", False):
        raise unsupported(optimizer, "`use_ema=True`")
    if getattr(optimizer, "loss_scale_factor", None) or hasattr(optimizer, "inner_optimizer"):
        raise unsupported(optimizer, "it scales the loss")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise unsupported(optimizer, "it accumulates gradients itself")


def _dedupe(g):
    """An `IndexedSlices` with unique indices (duplicates summed), still sparse."""
    unique, positions = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, g.dense_shape)


def _fold(slot, decay, first, g, scale, square=False):
    """slot <- slot * (decay if first else 1) + scale * (g or g^2)."""
    dtype = slot.dtype
    scale = tf.cast(scale, dtype)
    if isinstance(g, tf.IndexedSlices):
        g = _dedupe(g)
        values = tf.cast(g.values, dtype)
        if square:
            values = tf.square(values)
        tf.cond(first, lambda: slot.assign(slot * tf.cast(decay, dtype)), lambda: slot)
        slot.scatter_add(tf.IndexedSlices(values * scale, g.indices, g.dense_shape))
    else:
        g = tf.cast(g, dtype)
        if square:
            g = tf.square(g)
        factor = tf.where(first, tf.cast(decay, dtype), tf.ones((), dtype))
        slot.assign(slot * factor + scale * g)


def rule_for(optimizer, api, sgd, adam):
    """The `MomentumRule` for `optimizer`, or a Keras-style `ValueError`: `sgd`, `adam`
    (tuples of classes) are the family's SGD and Adam/AdamW classes (exactly, not their
    subclasses), `api` the family's `accum._inner.InnerApi` for `optimizer`."""
    check_common(optimizer)
    if type(optimizer) in sgd:
        if not api.has_momentum(optimizer):
            raise unsupported(optimizer, "`momentum=0` has no moment slot")
        if optimizer.nesterov:
            raise unsupported(optimizer, "`nesterov=True` needs the old momentum at the end")
        kind = SGD
    elif type(optimizer) in adam:
        if optimizer.amsgrad:
            raise unsupported(optimizer, "`amsgrad=True`")
        kind = ADAM
    else:
        raise unsupported(optimizer, "it is not SGD, Adam or AdamW")
    return MomentumRule(kind, SlotAdapter(optimizer, kind, api))


@dataclasses.dataclass(frozen=True)
class SlotAdapter:
    """What a `MomentumRule` asks of a built `optimizer` of any family, through the family's
    `accum._inner.InnerApi` (`api`): its slots (as `tf.Variable`s), hyperparameters,
    current learning rate and weight decay (`kind`: `SGD` or `ADAM`)."""

    optimizer: object
    kind: str
    api: object

    @property
    def hyper(self):
        # Read at each use (a legacy optimizer's hyperparameters are variables once created).
        opt = self.optimizer
        if self.kind == SGD:
            return {"momentum": opt.momentum}
        return {"beta_1": opt.beta_1, "beta_2": opt.beta_2, "epsilon": opt.epsilon}

    def slots(self, variable):
        return tuple(None if s is None else _tf_variable(s) for s in self.api.slots(self.optimizer, variable))

    def learning_rate(self, dtype):
        return self.api.current_learning_rate(self.optimizer, dtype)

    def apply_weight_decay(self, variables):
        self.api.apply_weight_decay(self.optimizer, variables)


class MomentumRule:
    """Folds micro-gradients into an inner optimizer's slots (see the module docstring).

    `adapter` (a `SlotAdapter`) gives family-specific access: `slots(var)` (the raw
    `tf.Variable` moments of `var`), `learning_rate(dtype)`, `hyper`,
    `apply_weight_decay(variables)`, and the inner `optimizer` (its `iterations`).
    """

    def __init__(self, kind, adapter):
        self.kind = kind
        self.adapter = adapter

    def check_built(self, inner, var_list):
        for v in var_list:
            if any(s is None for s in self.adapter.slots(v)):
                raise unsupported(inner, f"variable {v.name} has no moment slot")

    def accumulate(self, state, k, grads, indices):
        """One micro-step of a window of `k`: folds `grads` (of the variables at `indices`)
        into the slots (if finite) and counts it in `state` (the wrapper's
        `accum.modes._window.WindowState`, as the family's own variables).

        A variable's moments decay at its first kept micro-step in the window
        (its touched flag is still 0): a variable missing from some micro-steps
        counts zero gradients there, exactly as at batch `k * b`."""
        variables = [state.variables[i] for i in indices]
        flags = [_tf_variable(state.touched[i]) for i in indices]
        hyper = self.adapter.hyper

        def add():
            for g, var, flag in zip(grads, variables, flags):
                first = tf.equal(flag.read_value(), 0)
                slots = self.adapter.slots(var)
                if self.kind == SGD:
                    lr = self.adapter.learning_rate(slots[0].dtype)
                    _fold(slots[0], hyper["momentum"], first, g, -lr / k)
                else:
                    _fold(slots[0], hyper["beta_1"], first, g, (1.0 - hyper["beta_1"]) / k)
                    _fold(slots[1], hyper["beta_2"], first, g, (1.0 - hyper["beta_2"]) / k, square=True)
            _window.mark_touched(flags)
            state.window_count.assign_add(1)

        tf.cond(_window.all_finite(grads), add, lambda: None)
        state.window_steps.assign_add(1)

    def finish(self, state):
        """End of a window (`state`: as `accumulate`'s): weight decay, one move of the
        weights, one iteration.

        Only the variables the window touched move (a variable with no gradient
        in the whole window is left alone, as at batch `k * b`)."""
        variables = list(state.variables)
        touched = _window.touched_mask([_tf_variable(t) for t in state.touched])
        for var, t in zip(variables, touched):
            _window.guarded(t, lambda var=var: self.adapter.apply_weight_decay([var]))
        for var, t in zip(variables, touched):
            _window.guarded(t, lambda var=var: self._move(var))
        self.adapter.optimizer.iterations.assign_add(1)

    def _move(self, var):
        """The weights' move from the folded moments (inside the window's update)."""
        hyper = self.adapter.hyper
        slots = self.adapter.slots(var)
        dtype = slots[0].dtype
        if self.kind == SGD:
            var.assign_add(slots[0].read_value())
        else:
            lr = self.adapter.learning_rate(dtype)
            t = tf.cast(self.adapter.optimizer.iterations + 1, dtype)
            b1, b2 = tf.cast(hyper["beta_1"], dtype), tf.cast(hyper["beta_2"], dtype)
            alpha = lr * tf.sqrt(1.0 - tf.pow(b2, t)) / (1.0 - tf.pow(b1, t))
            m, v = slots[0].read_value(), slots[1].read_value()
            var.assign_sub(alpha * m / (tf.sqrt(v) + tf.cast(hyper["epsilon"], dtype)))
        if getattr(var, "constraint", None) is not None:
            # As the inner optimizer does after its update.
            var.assign(var.constraint(var))


def _tf_variable(variable):
    """The `tf.Variable` of a touched flag or a slot (Keras 3's are `keras.Variable`s)."""
    return variable if isinstance(variable, tf.Variable) else variable.value
