"""Tool: which `accum` modules one micro-step and one window's end go through.

    python -m benchmarks.accum_trace                 # Keras 3 on TensorFlow, eager, "buffer", Adam, k=2
    python -m benchmarks.accum_trace --path          # and the modules in the order entered

Traces (`sys.setprofile`) two `apply` calls of an `AccumOptimizer(Adam(), 2)` built
on a small model, after one whole window: the first is a micro-step, the second a
micro-step that ends the window. For each it prints the `accum` modules entered and
two counts of coming back into a module already left:

- `calls back`: calls from one `accum` module into another that the call had entered
  before (a collaborator calling back, e.g. a mode into the wrapper);
- `returns`: every time the running `accum` module changes to one already seen,
  by a call or by a return (what a reader following the code walks).

Nothing is timed; the numbers measure the layout, not the speed.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402

import accum  # noqa: E402

_ROOT = os.path.dirname(accum.__file__) + os.sep


def _module(frame):
    """The `accum` module (`accum/...py`) of `frame`, or None."""
    name = frame.f_code.co_filename
    return "accum" + os.sep + name[len(_ROOT):] if name.startswith(_ROOT) else None


def _nearest(frame):
    """The `accum` module of the nearest `accum` frame at or below `frame`, or None."""
    while frame is not None:
        module = _module(frame)
        if module is not None:
            return module
        frame = frame.f_back
    return None


def trace(fn):
    """Runs `fn()` under `sys.setprofile`: (the modules entered, calls back, returns, the
    path of modules the running code was in)."""
    path, calls_back, entered = [], 0, set()

    def profile(frame, event, arg):
        nonlocal calls_back
        if event not in ("call", "return"):
            return
        if event == "call":
            callee, caller = _module(frame), _nearest(frame.f_back)
            if callee is not None and caller is not None and callee != caller and callee in entered:
                calls_back += 1
            if callee is not None:
                entered.add(callee)
            now = callee or caller
        else:
            now = _nearest(frame.f_back)
        if now is not None and (not path or path[-1] != now):
            path.append(now)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    seen, returns = set(), 0
    for module in path:
        returns += module in seen
        seen.add(module)
    return sorted(seen), calls_back, returns, path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", action="store_true", help="print the modules in the order entered")
    parser.add_argument("--mode", default="buffer", choices=("buffer", "momentum", "rescale"))
    args = parser.parse_args(argv)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    optimizer = accum.AccumOptimizer(keras.optimizers.Adam(1e-3), 2, mode=args.mode)
    variables = model.trainable_variables
    optimizer.build(variables)
    grads = [keras.ops.ones(v.shape) for v in variables]
    for _ in range(2):  # one whole window first: nothing traced is a first call's
        optimizer.apply(grads, variables)
    for name in ("micro-step", "window end"):
        modules, calls_back, returns, path = trace(lambda: optimizer.apply(grads, variables))
        print(f"{name}: {len(modules)} modules, {calls_back} calls back, {returns} returns")
        print("  " + ", ".join(modules))
        if args.path:
            print("  path: " + " -> ".join(path))


if __name__ == "__main__":
    main()
