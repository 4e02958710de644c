"""When recomputation is on: the `RECOMPUTE` environment variable and a runtime switch.

The environment is read every time a decorated layer runs (not at import), so
`os.environ["RECOMPUTE"] = "1"` in a notebook takes effect at the next call --
or, inside `tf.function`/`model.fit`, at the next trace. The context manager
`recompute_scope` overrides the environment for the code it wraps.
"""

import contextlib
import contextvars
import os

ENV_VAR = "RECOMPUTE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# None: follow the environment; True/False: forced by `recompute_scope`.
_override = contextvars.ContextVar("recompute_override", default=None)


def _parse(value):
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(
        f"The environment variable `{ENV_VAR}` must be one of "
        "1/true/yes/on (enable) or 0/false/no/off (disable), or unset. "
        f"Received: {ENV_VAR}={value!r}"
    )


def is_enabled():
    """Returns whether decorated layers recompute their activations now.

    The innermost active `recompute_scope` decides; without one, the
    `RECOMPUTE` environment variable (read now, not at import): `1`, `true`,
    `yes`, `on` enable it; `0`, `false`, `no`, `off` or unset disable it
    (case-insensitive). Any other value raises `ValueError` naming it.
    """
    forced = _override.get()
    if forced is not None:
        return forced
    return _parse(os.environ.get(ENV_VAR, ""))


@contextlib.contextmanager
def recompute_scope(enabled=True):
    """Context manager that turns recomputation on or off, whatever `RECOMPUTE` says.

    ```python
    with recompute.recompute_scope(True):
        loss = train_step(x, y)      # decorated layers recompute here
    with recompute.recompute_scope(False):
        loss = train_step(x, y)      # and run normally here
    ```

    Scopes nest; the innermost wins. Inside `tf.function` the setting in force
    when the function is *traced* is the one baked into the graph.

    Args:
        enabled: `True` or `False`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            "`enabled` must be a bool (True or False). "
            f"Received: enabled={enabled!r} of type {type(enabled).__name__}"
        )
    token = _override.set(enabled)
    try:
        yield
    finally:
        _override.reset(token)
