"""`mode="rescale"`: accumulation hidden in the optimizer's own moving averages, no buffer.

The recipe ("hidden in the momentum"): run the inner optimizer at every
micro-step on the micro-batch's gradient, with every moving-average
coefficient `β` replaced by

    β̃ = 1 − (1 − β) / k,

and move the weights only at the `k`-th micro-step of each window.

Why. An average `m ← β m + (1 − β) g` run over the `k` micro-steps of a window
with `β̃` gives

    m ← β̃ᵏ m + ((1 − β) / k) · Σⱼ β̃^(k−j) gⱼ
      ≈ β m + (1 − β) · ḡ            (β̃ᵏ = β + O((1 − β)²), β̃^(k−j) ≈ 1),

the same average of the window's mean gradient `ḡ` that the inner optimizer
keeps at batch `k · b`. The weights' move reads the averages at the end of
the window, as the big batch's update does. A heavy-ball momentum
`v ← μ v − η g` (Keras's SGD; RMSprop's `momentum`) has no `(1 − μ)` factor:
there `μ̃` and a learning rate `η / k` in the momentum give `v ≈ μ v − η ḡ`.

So the recipe is approximate (exact for `k = 1`): each gradient is weighted
by `β̃^(k−j)` instead of `1`, a decay `β̃ᵏ` replaces `β`, and an average of a
nonlinear function of the gradient (Adam's second moment) averages the
micro-gradients' squares, not the square of their mean (as `mode="momentum"`
does for Adam). `docs/rescale.md` measures how far it ends from batch `k · b`,
beside `mode="buffer"` (exact) and `mode="momentum"`.

What the wrapper does at each micro-step (`accum.keras3._rescale_step`, `accum.tf_keras._rescale_step`):
- The inner optimizer's update runs with the attributes `Rescale.coefficients`
  set to `β̃` (instance attributes while the update is traced, then restored,
  so its config keeps `β`).
- Its iteration count is the micro-step count `n`, so bias corrections are
  those of the `β̃` averages, `1 − β̃ⁿ` (at update `t`, `1 − β̃ᵏᵗ ≈ 1 − βᵗ`).
- Its learning rate is the one at update `t` (schedules count updates, read
  from the inner optimizer's `iterations`, which counts updates), divided by
  `k` for a heavy-ball momentum.
- Assignments to the model's variables are kept at the `k`-th micro-step
  only; weight decay runs there only, with the update's learning rate.
- A variable without a gradient in a micro-step gets a zero gradient (its
  averages decay), as at batch `k · b`. A non-finite micro-step counts as a
  zero gradient too, wherever it falls in the window: the window still ends
  with its update at its `k`-th micro-step (a `LossScaleOptimizer` outside
  the wrapper skips such a step before it reaches the wrapper).

No per-parameter state is added: the window is the micro-step counter.

Precision. The inner optimizer computes with `β̃` in its variables' dtype. In
float32, `β̃` is rounded to a multiple of 2⁻²⁴ (the spacing just below 1), so
`1 − β̃ = (1 − β)/k` loses its precision as `k` grows, and becomes 0 (`β̃ =
1.0`: the average never moves, Adam's bias correction is 0 and the weights
stay) once `(1 − β)/k` is under 2⁻²⁵. `mode="rescale"` refuses a `k` for which
the rounding may put `1 − β̃` more than `PRECISION` (1%) off `(1 − β)/k`, for
every coefficient it rewrites: `k ≤ PRECISION · (1 − β) · 2²⁵` in float32 (33
for `β = 0.9999`, 335 for 0.999, 33554 for 0.9), at construction for
`floatx()` and again when built, for the variables' dtypes (float64 variables
allow `k` up to about 10¹¹ for `β = 0.999`).

Optimizers whose weights move by the current gradient rather than by a moving
average of it (RMSprop without momentum, Adadelta, Adafactor) are rescaled
too (their second-moment averages see every micro-gradient), but only the
window's last micro-gradient moves the weights: a warning says so. Adafactor's
`β₂ = 1 − t^beta_2_decay` is a schedule, counted in micro-steps, not rescaled.
"""

import dataclasses
import math
import numbers
import warnings

MODE = "rescale"

# By class name (the same in Keras 3 and tf_keras): the attributes that are
# moving-average coefficients of the form `m ← β m + (1 − β) x`.
_AVERAGES = {
    "Adam": ("beta_1", "beta_2"),
    "AdamW": ("beta_1", "beta_2"),
    "Adamax": ("beta_1", "beta_2"),
    "Nadam": ("beta_1", "beta_2"),
    "Lamb": ("beta_1", "beta_2"),
    "Lion": ("beta_1", "beta_2"),
    "RMSprop": ("rho",),
    "Adadelta": ("rho",),
    "SGD": (),
    # β₂ = 1 − tᵈᵉᶜᵃʸ is a schedule of the step: counted in micro-steps, not rescaled.
    "Adafactor": (),
}
# A heavy-ball momentum `v ← μ v + η x` (the attribute `momentum`, when > 0).
_HEAVY_BALL = ("SGD", "RMSprop")
# Whose weights move by the current gradient, not by a moving average of it
# (unless a heavy-ball momentum is set).
_NO_FIRST_MOMENT = ("RMSprop", "Adadelta", "Adafactor")

SUPPORTED = ("Adam", "AdamW", "Adamax", "Nadam", "Lamb", "Lion", "RMSprop", "Adadelta",
             "Adafactor", "SGD with momentum > 0")

# How far off `(1 − β)/k` the represented `1 − β̃` may be (relative), whatever the rounding.
PRECISION = 0.01
# The spacing of each float dtype just below 1: `β̃` rounds to within half of it.
_SPACING_BELOW_ONE = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def rescaled(beta, k):
    """`β̃ = 1 − (1 − β) / k`."""
    return 1.0 - (1.0 - float(beta)) / k


def largest_steps_per_update(beta, dtype):
    """The largest `k` for which `β̃ = 1 − (1 − β)/k`, rounded to `dtype`, keeps `1 − β̃`
    within `PRECISION` of `(1 − β)/k` whatever the rounding (None: no limit, `β = 1`)."""
    if float(beta) == 1.0:
        return None  # β̃ = 1 for every k, exactly
    return max(1, math.floor(PRECISION * (1.0 - float(beta)) / (_SPACING_BELOW_ONE[dtype] / 2)))


def _rounded(value, dtype):
    """`value` rounded to `dtype` (as NumPy and the backends' casts round), as a Python float."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return float(np.asarray(value, ml_dtypes.bfloat16))
    return float(np.asarray(value, dtype))


def unsupported(optimizer, reason):
    """The Keras-style error for an optimizer `mode="rescale"` cannot rescale."""
    return ValueError(
        '`mode="rescale"` needs an optimizer with moving-average coefficients '
        f"({', '.join(SUPPORTED)}); {reason}. Use "
        '`mode="buffer"` (exact for every optimizer). '
        f"Received: optimizer={type(optimizer).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class Rescale:
    """What `mode="rescale"` changes in one inner optimizer.

    Attributes:
        k: micro-steps per update.
        coefficients: {attribute: β} of the moving-average coefficients
            (including a heavy-ball `momentum`), as configured.
        heavy_ball: whether the weights move by a heavy-ball momentum (whose
            gradient term carries the learning rate, divided by `k`).
    """

    k: int
    coefficients: dict
    heavy_ball: bool

    def hooks(self):
        """{attribute: β̃}: the instance attributes set while a micro-step is traced."""
        return {name: rescaled(beta, self.k) for name, beta in self.coefficients.items()}

    def learning_rate(self, learning_rate):
        """The learning rate the inner optimizer uses at a micro-step."""
        return learning_rate / self.k if self.heavy_ball else learning_rate

    def check_dtype(self, dtype, where):
        """Raises a Keras-style `ValueError` if a rewritten coefficient, computed in `dtype`
        (a float dtype name), may be more than `PRECISION` off (see the module docstring).
        `where`: how `dtype` was found, for the message."""
        if self.k == 1 or dtype not in _SPACING_BELOW_ONE:
            return  # k = 1 rewrites nothing; not a float dtype: nothing computed in it
        spacing = _SPACING_BELOW_ONE[dtype]
        # The most constrained coefficient first (the smallest 1 − β).
        for name, beta in sorted(self.coefficients.items(), key=lambda item: -item[1]):
            largest = largest_steps_per_update(beta, dtype)
            if largest is None or self.k <= largest:
                continue
            wanted = (1.0 - beta) / self.k
            rounded = _rounded(1.0 - wanted, dtype)
            got = 1.0 - rounded
            digits = 17 if dtype == "float64" else 9
            advice = (" (construct the AccumOptimizer with `floatx()` \"float64\" too)"
                      if where.startswith("`floatx()`") else "")
            raise ValueError(
                f'`mode="rescale"` rewrites `{name}` as β̃ = 1 − (1 − {name})/steps_per_update '
                f"= {1.0 - wanted!r}, and the inner optimizer computes with β̃ in {dtype} "
                f"({where}), which rounds it to a multiple of 2**{round(math.log2(spacing))} "
                f"near 1: here to {rounded:.{digits}g}, so 1 − β̃ = {got:.3g} instead of {wanted:.3g} "
                f"({abs(got - wanted) / wanted * 100:.3g}% off"
                f"{': the average would never move' if got == 0 else ''}), and at this "
                f"steps_per_update the rounding may put it up to {spacing / 2 / wanted * 100:.3g}% off. "
                f"1 − β̃ stays within {PRECISION:.0%} of (1 − {name})/steps_per_update for every "
                f"steps_per_update <= {largest} with {name}={beta!r} in {dtype}. Use "
                f"steps_per_update <= {largest}, `mode=\"buffer\"` (exact for every "
                f"steps_per_update){'' if dtype == 'float64' else ', or float64 variables' + advice}. "
                f"Received: steps_per_update={self.k}, {name}={beta!r}, dtype={dtype}"
            )

    def check_variables(self, variables, dtype_of):
        """`check_dtype` for every dtype among `variables` (when the wrapper is built);
        `dtype_of(variable)`: the dtype name the inner optimizer computes in for it."""
        first = {}
        for variable in variables:
            first.setdefault(dtype_of(variable), variable)
        for dtype, variable in first.items():
            name = getattr(variable, "path", None) or variable.name
            self.check_dtype(dtype, f"the dtype of the variable {name!r}")


def spec_for(optimizer, k, classes, family_description, dtype):
    """The `Rescale` of `optimizer`, or a Keras-style `ValueError` naming it.

    `classes`: the family's optimizer namespace (`keras.optimizers`,
    `tf_keras.optimizers`); the optimizer must be one of its classes exactly
    (a subclass may change the update rule). `dtype`: the float dtype its
    variables will have (the family's `floatx()`), where the rewritten
    coefficients must keep their precision (`Rescale.check_dtype`).
    """
    name = type(optimizer).__name__
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None or getattr(optimizer, "loss_scale_factor", None):
        raise ValueError(
            '`mode="rescale"` cannot wrap a loss-scaling optimizer: it rewrites the '
            "coefficients of the optimizer it wraps and runs that optimizer's update at every "
            "micro-step, with nothing in between. Put the loss scaling outside instead: wrap "
            "the AccumOptimizer in the LossScaleOptimizer, `LossScaleOptimizer(AccumOptimizer("
            f'{type(inner).__name__ if inner is not None else name}(...), {k}, mode="rescale"))` '
            '(or use `mode="buffer"`, which takes a LossScaleOptimizer inside). '
            f"Received: optimizer={name}"
            + (f" wrapping {type(inner).__name__}" if inner is not None
               else f" with loss_scale_factor={optimizer.loss_scale_factor!r}")
        )
    known = getattr(classes, name, None)
    if known is None or type(optimizer) is not known or name not in _AVERAGES:
        reason = (
            f"{name} keeps no moving average"
            if known is not None and type(optimizer) is known
            else f"{name} is not one of the {family_description} optimizers it knows"
        )
        raise unsupported(optimizer, reason)
    if getattr(optimizer, "use_ema", False):
        raise unsupported(
            optimizer, "`use_ema=True`: the weights' moving average counts the optimizer's steps"
        )
    names = _AVERAGES[name]
    heavy_ball = False
    if name in _HEAVY_BALL:
        momentum = getattr(optimizer, "momentum", 0.0)
        if not _is_number(momentum):
            raise unsupported(optimizer, f"`momentum` must be a number. Received: momentum={momentum!r}")
        heavy_ball = momentum > 0
        if heavy_ball:
            names = names + ("momentum",)
        elif not names:
            raise unsupported(optimizer, f"{name} with momentum={momentum!r} keeps no moving average (set `momentum` > 0)")
    coefficients = {}
    for attribute in names:
        beta = getattr(optimizer, attribute)
        if not _is_number(beta) or not 0.0 <= float(beta) <= 1.0:
            raise unsupported(
                optimizer,
                f"`{attribute}` must be a number in [0, 1] to be rescaled. "
                f"Received: {attribute}={beta!r}",
            )
        coefficients[attribute] = float(beta)
    spec = Rescale(k=k, coefficients=coefficients, heavy_ball=heavy_ball)
    spec.check_dtype(dtype, "`floatx()`, the default dtype of variables")
    if name in _NO_FIRST_MOMENT and not heavy_ball and k > 1:  # k = 1: every micro-step moves
        warnings.warn(
            f'AccumOptimizer(..., mode="rescale"): {name}{" with momentum=0" if name in _HEAVY_BALL else ""} '
            "moves the weights by the current gradient, not by a moving average of it, so at "
            f"each update only the window's last micro-gradient (1 of {k}) moves the weights; "
            "the others reach only its moving averages. Use mode=\"buffer\" to accumulate "
            f"every micro-gradient{' (or set momentum > 0)' if name in _HEAVY_BALL else ''}.",
            stacklevel=4,
        )
    return spec


@dataclasses.dataclass(frozen=True)
class Step:
    """What a family's rescaled micro-step (`micro_step(step, grads, indices)` of
    `accum.keras3._rescale_step`, `accum.tf_keras._rescale_step`) works on, given by the
    family (`accum._base.WrapperOps.rescale_state`, through `Rescale.micro_step`).

    Attributes:
        spec: the `Rescale` of the inner optimizer.
        inner: the inner optimizer.
        variables: the model variables the wrapper was built on, in its order.
        micro_steps: the wrapper's micro-step counter (a variable).
        window_steps: the micro-steps of the current window (a variable).
        finish_batch_norm: `f(last)`, the window's end of the linked
            `accum.BatchNormalization` layers where the scalar bool `last` holds.
    """

    spec: Rescale
    inner: object
    variables: list
    micro_steps: object
    window_steps: object
    finish_batch_norm: object

    def gradients(self, indices, grads, zeros):
        """A gradient for each variable (`every_gradient`)."""
        return every_gradient(self.variables, indices, grads, zeros)


def every_gradient(variables, indices, grads, zeros):
    """A gradient for each of `variables`: `grads` at `indices`, `zeros(variable)` for the
    others (a variable missing from a micro-step counts a zero gradient there)."""
    given = dict(zip(indices, grads))
    return [given[i] if i in given else zeros(v) for i, v in enumerate(variables)]


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
