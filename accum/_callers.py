"""What `accum` reads off the call stack, in one place: the model a Keras method runs for,
and the module that constructs an `accum.BatchNormalization`.

Keras gives an optimizer no link to the model that compiles or trains it: `compile`
keeps the optimizer in `model.optimizer` and tells it nothing, and `fit` and
`train_on_batch` call only the optimizer's own methods (`build(variables)`,
`apply_gradients`, `finalize_variable_values`), never with the model; a layer has no
link to the model whose train step calls it. The explicit links left would be a patch
of Keras's `Model` class (every model of the process, not only those `accum` trains) or
a model the user passes (a change of the public API and of what `compile` + `fit` do
today), so `accum` looks at the calling frames, as `warnings.warn`'s `stacklevel` does,
here and nowhere else:

- `model_calling(optimizer)`: the model whose method (`fit`, `train_on_batch`, `compile`)
  builds or finalizes `optimizer` (`accum._recompile`, `accum.batchnorm._warning`);
- `self_running(code)`: the `self` of the innermost call of `code` (the family's
  `Model.train_step`: the model whose train step runs a layer, `accum.batchnorm._layer`);
- `caller_imports(inside)`: the modules imported by the first calling module outside the
  packages `inside` (the family of an `accum.BatchNormalization`, `accum.batchnorm._layer`).

`PRIVATE_NAMES` lists the private interpreter names these rely on, in the format of
`accum._inner`'s (an owner `"a frame"` is a frame the test makes);
tests/accum_keras3/test_private_interface_accum.py checks them on the running Python.
"""

import sys

_A_FRAME = "a frame"
PRIVATE_NAMES = (
    ("_getframe", ("sys",)),
    ("f_back", (_A_FRAME,)),
    ("f_locals", (_A_FRAME,)),
    ("f_code", (_A_FRAME,)),
    ("f_globals", (_A_FRAME,)),
)

_MAX_FRAMES = 24


def chain(optimizer):
    """`optimizer` and the optimizers it wraps (`inner_optimizer`), outermost first."""
    found = []
    while optimizer is not None and all(optimizer is not o for o in found):
        found.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def model_calling(optimizer):
    """The model whose method (`fit`, `train_on_batch`, ...) called us with `optimizer`
    (its `optimizer`, or one it wraps): `self` in one of the `_MAX_FRAMES` calling
    frames, with `layers` and an `optimizer` whose chain holds `optimizer`; or None."""
    frame = sys._getframe(0)
    try:
        for _ in range(_MAX_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if candidate is None or candidate is optimizer or not hasattr(candidate, "layers"):
                continue
            if any(o is optimizer for o in chain(getattr(candidate, "optimizer", None))):
                return candidate
        return None
    finally:
        del frame


def self_running(code):
    """The `self` of the innermost running call of `code` (a code object) among our
    caller and the frames calling it, or None."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("self")
            frame = frame.f_back
        return None
    finally:
        del frame


def caller_imports(inside, depth=2):
    """The names of the modules held in the globals of the first calling module not in
    a package of `inside` (name prefixes), looked for from `depth` frames above our
    caller on; None if there is none."""
    frame = sys._getframe(depth + 1)
    try:
        while frame is not None and frame.f_globals.get("__name__", "").startswith(inside):
            frame = frame.f_back
        if frame is None:
            return None
        return {getattr(v, "__name__", None) for v in frame.f_globals.values() if type(v) is type(sys)}
    finally:
        del frame
