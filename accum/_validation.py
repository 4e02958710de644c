"""Argument checks shared by every backend, with Keras-style error messages."""

import numbers

MODES = ("buffer", "momentum", "rescale")

# The window counters are int64 variables: `window_steps` reaches `k`.
MAX_STEPS_PER_UPDATE = 2**63 - 1
# On JAX without `jax_enable_x64`, int64 variables hold int32 (`accum.keras3._jax`).
MAX_STEPS_PER_UPDATE_INT32 = 2**31 - 1


def check_steps_per_update(steps_per_update):
    """Returns `steps_per_update` as an `int`, or raises a Keras-style `ValueError`.

    Accepts Python and NumPy integers from 1 to `2**63 - 1` (the window
    counters are int64; on JAX without `jax_enable_x64` they hold int32, and
    `accum.keras3._jax` refuses more than `MAX_STEPS_PER_UPDATE_INT32`).
    Rejects booleans, floats (even integral ones such as `4.0`), strings and
    everything else.
    """
    if (
        isinstance(steps_per_update, bool)
        or not isinstance(steps_per_update, numbers.Integral)
        or steps_per_update < 1
    ):
        raise ValueError(
            "`steps_per_update` must be an integer >= 1. "
            f"Received: steps_per_update={steps_per_update!r}"
        )
    if steps_per_update > MAX_STEPS_PER_UPDATE:
        raise ValueError(
            "`steps_per_update` must be an integer >= 1 and <= 2**63 - 1 (the "
            "window counters are int64). "
            f"Received: steps_per_update={steps_per_update!r}"
        )
    return int(steps_per_update)


def check_mode(mode):
    """Returns `mode` if it is one of `MODES`, or raises a Keras-style `ValueError`."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"`mode` must be one of {', '.join(repr(m) for m in MODES)}. "
            f"Received: mode={mode!r}"
        )
    return mode
