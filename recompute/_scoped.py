"""Two things `recompute` scopes to a `with` block, written once.

- `ThreadStack`: what this thread is inside of, innermost last (the recomputed calls of
  the TensorFlow engine, tf_keras's replayed random draws, bert4keras's attention
  layers, the keras-hub models whose chunked step runs). `entered(value)` pushes for the
  block; `top()` is the innermost, or None.
- `shadowed(replacements)`: instance attributes set for the block on objects `recompute`
  does not own (a layer's attention core, its GELU), past a tracking `__setattr__`
  (Keras's, tf_keras's: nothing is tracked or saved), and restored on exit to what was
  there: the instance attribute's old value, or nothing, so the class's shows again.

A leaf: it imports nothing of `recompute`.
"""

import contextlib
import threading

_MISSING = object()


class ThreadStack(threading.local):
    """A stack per thread (each thread starts empty)."""

    def __init__(self):
        super().__init__()
        self.items = []

    @contextlib.contextmanager
    def entered(self, value):
        """Pushes `value` for the block (yielding it), pops it on exit."""
        self.items.append(value)
        try:
            yield value
        finally:
            self.items.pop()

    def top(self):
        """The innermost value entered in this thread, or None."""
        return self.items[-1] if self.items else None

    def __bool__(self):
        return bool(self.items)


@contextlib.contextmanager
def shadowed(replacements):
    """Sets each `(obj, name, value)` of `replacements` (an iterable, consumed inside the
    block, so that what it set is restored if it raises) as an instance attribute, and
    restores every one on exit, last set first restored."""
    restore = []
    try:
        for obj, name, value in replacements:
            restore.append((obj, name, vars(obj).get(name, _MISSING)))
            object.__setattr__(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(restore):
            if old is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, old)
