"""A process-wide setting used as a statement or as a context manager: `Setting`.

`exact_float32()` and `attention_block_size(rows)` are both. As a statement
(`recompute.exact_float32()`) the setting holds from the call on. As a
context manager it holds inside the block, and on exit the state in force
when that block was *entered* comes back:

- `with exact_float32():` -- the object is made and entered at once: the
  state before it was made comes back;
- one object entered twice (`scope = exact_float32()`, then two `with
  scope:` blocks) applies the setting at each entry, so the second block
  runs with it too;
- an object made earlier and entered after another change of the setting
  (a later statement, another scope) restores what was in force at its
  entry, not at its making, so it never undoes that later change.

An object counts as "made and entered at once" when no change of its kind of
setting came between (a counter per subclass) and the state is still the one
it applied. Nested entries of one object restore in reverse order.
"""


class Setting:
    """Subclasses define `_read()` (the current state), `_write(state)` and `_wanted()`
    (the state this object applies) -- or, for a setting held in a one-element list
    `_cell`, only that list: the state is `_cell[0]`, the object applies the `value` it
    was made with, and its repr is `name(value)`."""

    _changes = 0  # per subclass (assigned on the subclass at the first change)
    _cell = None  # a one-element list holding the state, for the default methods

    def __init__(self, value=None):
        self._value = value
        self._made_from = self._read()
        self._apply()
        self._made_at = type(self)._changes
        self._entered = []  # the states to restore, innermost last

    def _apply(self):
        self._write(self._wanted())
        type(self)._changes = type(self)._changes + 1

    def __enter__(self):
        state = self._read()
        just_made = (not self._entered and self._made_at == type(self)._changes
                     and state == self._wanted())
        self._entered.append(self._made_from if just_made else state)
        self._made_at = None  # entered: from now on, each entry saves what it finds
        self._apply()
        return self

    def __exit__(self, *exc_info):
        self._write(self._entered.pop())
        type(self)._changes = type(self)._changes + 1
        return False

    def _read(self):
        return self._cell[0]

    def _write(self, state):
        self._cell[0] = state

    def _wanted(self):
        return self._value

    def __repr__(self):
        return f"{type(self).__name__}({self._value!r})"
