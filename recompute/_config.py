"""When recomputation is on: the `RECOMPUTE` environment variable and a runtime switch.

The environment is read every time a decorated layer runs (not at import), so
`os.environ["RECOMPUTE"] = "1"` in a notebook takes effect at the next call --
or, inside `tf.function`/`model.fit`, at the next trace. The context manager
`recompute_scope` overrides the environment for the code it wraps.

Under `tf.distribute.MirroredStrategy` and `MultiWorkerMirroredStrategy`,
`strategy.run` (and so `model.fit`) calls the replica function in threads of
its own, which a context variable does not reach. So each scope is also
registered by thread, and a replica thread with no scope of its own follows
the scopes active in the other (non-replica) threads -- the thread that
called `strategy.run` among them. If those disagree (two threads training
under scopes of opposite settings at once), the replica cannot tell which one
started it and `is_enabled` raises; set the scope inside the replica function
or use the environment variable then.
"""

import contextlib
import contextvars
import os
import threading

from .adapters import _tf

ENV_VAR = "RECOMPUTE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# None: follow the environment; True/False: forced by `recompute_scope`.
_override = contextvars.ContextVar("recompute_override", default=None)

# thread id -> [(token, enabled)]: the scopes active in each thread that is not
# a tf.distribute replica thread, innermost last (what replica threads inherit).
_thread_scopes = {}
_lock = threading.Lock()


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
    (case-insensitive; surrounding whitespace ignored, so a blank value
    disables it). Any other value raises `ValueError` naming it.
    """
    forced = _override.get()
    if forced is not None:
        return forced
    inherited = _inherited_override()
    if inherited is not None:
        return inherited
    return _parse(os.environ.get(ENV_VAR, ""))


def _inherited_override():
    """In a tf.distribute replica thread: the setting of the scopes active elsewhere, or None."""
    if not _thread_scopes or not _tf.in_replica_thread():
        return None
    with _lock:
        settings = {scopes[-1][1] for scopes in _thread_scopes.values()}
    if len(settings) > 1:
        raise RuntimeError(
            "recompute_grad: a tf.distribute replica (`strategy.run`, `model.fit` "
            "under a strategy) cannot tell whether to recompute: "
            "`recompute_scope(True)` and `recompute_scope(False)` are both active, "
            "in different threads. Enter the scope inside the replica function, or "
            f"set the environment variable `{ENV_VAR}` instead."
        )
    return settings.pop() if settings else None


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
    when the function is *traced* is the one baked into the graph. Under
    `MirroredStrategy`/`MultiWorkerMirroredStrategy`, the replica threads of
    `strategy.run` (and of `model.fit`) follow the scope of the thread that
    runs them (see the module docstring).

    Args:
        enabled: `True` or `False`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            "`enabled` must be a bool (True or False). "
            f"Received: enabled={enabled!r} of type {type(enabled).__name__}"
        )
    token = _override.set(enabled)
    registered = None if _tf.in_replica_thread() else threading.get_ident()
    entry = (object(), enabled)
    if registered is not None:
        with _lock:
            _thread_scopes.setdefault(registered, []).append(entry)
    try:
        yield
    finally:
        if registered is not None:
            with _lock:
                scopes = _thread_scopes[registered]
                scopes.remove(entry)
                if not scopes:
                    del _thread_scopes[registered]
        _override.reset(token)
