"""The all-reduces of a compiled JAX step, read from XLA's optimized HLO text.

```python
text = compiled_train_step_text(model, x, y)     # Keras's JAX train step, as `fit` jits it
ops = all_reduces(text)
every_step = [op for op in ops if not op.conditional]
```

`all_reduces(text)` lists each `all-reduce` (or async `all-reduce-start`)
instruction of `jax.jit(f).lower(...).compile().as_text()`: the computation
it is in, its shapes (a tuple all-reduce, XLA's combination of several, has
several), the elements it reduces, and whether it runs only inside a
`conditional` branch (a `jax.lax.cond`: XLA runs the branch taken only), as
opposed to on every call of the step. Counting instructions, not rounds:
XLA's all-reduce combiner merges the independent all-reduces of a step into
one tuple all-reduce, so "one instruction" can be every gradient at once --
read `elements` for the traffic.

Limits: a text parser of XLA's HLO dump (`%name = shape opcode(...)`, one
instruction a line, computations opened by `name (...) -> ... {` and closed
by `}`); an all-reduce in a `while` body (a `jax.lax.scan`) is counted once,
not once per iteration.
"""

import dataclasses
import math
import re

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_ALL_REDUCE = re.compile(r"=\s*(.+?)\s+all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BRANCHES = re.compile(r"(?:true_computation|false_computation)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|called_computations)=\{?%?([\w.\-]+)")


@dataclasses.dataclass
class AllReduce:
    computation: str
    shapes: list  # (dtype, dims) of each operand
    conditional: bool  # only inside a conditional's branch

    @property
    def floats(self):
        """Whether it reduces floating-point values (not only flags such as "all finite")."""
        return any(dtype.startswith(("f", "bf")) for dtype, _ in self.shapes)

    @property
    def elements(self):
        return sum(math.prod(dims) for _, dims in self.shapes)


def all_reduces(text):
    """The `AllReduce`s of an HLO module's text (see the module docstring)."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    assert entry is not None, "no ENTRY computation in the HLO text"

    # Computations run on every call: reachable from ENTRY without entering a conditional's branch.
    unconditional, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in unconditional:
            continue
        unconditional.add(name)
        for line in computations.get(name, ()):
            todo.extend(m for m in _CALLS.findall(line) if m in computations)

    found = []
    for name, lines in computations.items():
        for line in lines:
            match = _ALL_REDUCE.search(line)
            if match and "all-reduce-done" not in line:
                shapes = [(dtype, tuple(int(d) for d in dims.split(",") if d))
                          for dtype, dims in _ARRAY.findall(match.group(1))]
                found.append(AllReduce(name, shapes, name not in unconditional))
    return found


def compiled_train_step_text(model, x, y):
    """The optimized HLO text of Keras's JAX train step (`model.train_step`, what `fit`
    jits) for one batch `(x, y)`, laid out by the current `keras.distribution` as `fit`
    lays it out. Builds the model's optimizer if needed; trains nothing."""
    import jax
    import keras

    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    model.make_train_function()  # what `fit` does before it reads the state
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    data = (x, y)
    dist = keras.distribution.distribution()
    if dist is not None:
        data = tuple(keras.distribution.distribute_tensor(a, dist.get_data_layout(a.shape)) for a in data)
    return jax.jit(model.train_step).lower(state, data).compile().as_text()
