"""Save/resume of `AccumOptimizer` models in a fresh process (tests/accum_*/test_save_resume.py).

The test process trains a model `STOP` micro-steps (k=`K`: two updates and 3
micro-steps pending), saves it in every format, and goes on to `N` micro-steps
(the uninterrupted reference). This script, run as a fresh process
(`python save_resume_worker.py jobs.json`), loads each saved file, finishes the
`N` micro-steps and writes the weights and optimizer state to `job["out"]`
(`.npz`), to be compared bit for bit with the reference.

A job (JSON): `lib` ("keras" or "tf_keras"), `optimizer` (see `make_optimizer`),
`model` ("sequential", "functional", "subclassed"), `format` (see `save`,
`load`), `path`, `out`, optional `custom_objects` (pass
`{"AccumOptimizer": AccumOptimizer}` to `load_model`). The process only imports
the Keras library and `accum` before loading: no optimizer is built first.
"""

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import numpy as np  # noqa: E402

from tests.helpers.numerics import accelerator, max_rel_err  # noqa: E402

K, B, STOP, N = 4, 3, 7, 12
FEATURES, UNITS, OUTPUTS = 5, 4, 2
LOAD_MODEL_FORMATS = {"keras", "h5", "savedmodel"}  # the others: load_weights into a fresh model

_SUBCLASSED = {}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N * B, FEATURES)).astype("float32")
    y = rng.normal(size=(N * B, OUTPUTS)).astype("float32")
    return x, y


def train(model, start, stop):
    """Micro-steps `start..stop-1` with `train_on_batch` (one micro-batch each)."""
    x, y = data()
    for i in range(start, stop):
        model.train_on_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])


def subclassed_class(lib):
    """A registered subclassed model with `get_config` (created once per Keras library)."""
    if lib in _SUBCLASSED:
        return _SUBCLASSED[lib]
    keras = importlib.import_module(lib)

    @keras.saving.register_keras_serializable(package="accum_tests")
    class SaveResumeNet(keras.Model):
        def __init__(self, units=UNITS, outputs=OUTPUTS, **kwargs):
            super().__init__(**kwargs)
            self.units, self.outputs_ = units, outputs
            self.hidden = keras.layers.Dense(units, activation="tanh")
            self.head = keras.layers.Dense(outputs)

        def call(self, inputs):
            return self.head(self.hidden(inputs))

        def get_config(self):
            return {**super().get_config(), "units": self.units, "outputs": self.outputs_}

    _SUBCLASSED[lib] = SaveResumeNet
    return SaveResumeNet


def make_model(lib, kind, seed):
    keras = importlib.import_module(lib)
    keras.utils.set_random_seed(seed)
    if kind == "sequential":
        return keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(UNITS, activation="tanh"),
            keras.layers.Dense(OUTPUTS),
        ])
    if kind == "functional":
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(UNITS, activation="tanh")(inputs)
        return keras.Model(inputs, keras.layers.Dense(OUTPUTS)(hidden))
    model = subclassed_class(lib)()
    model(np.zeros((1, FEATURES), "float32"))
    return model


def make_optimizer(lib, spec):
    """`spec`: "adam" (Adam with an LR schedule), "legacy_adam" (tf_keras legacy),
    "momentum" (SGD with momentum, `mode="momentum"`) or "rescale" (Adam with an LR
    schedule, `mode="rescale"`)."""
    from accum import AccumOptimizer

    keras = importlib.import_module(lib)
    if spec == "momentum":
        return AccumOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), K, mode="momentum")
    optimizers = keras.optimizers.legacy if spec == "legacy_adam" else keras.optimizers
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, 1, 0.8)
    return AccumOptimizer(optimizers.Adam(schedule), K, mode="rescale" if spec == "rescale" else "buffer")


def compiled_model(lib, kind, spec, seed):
    model = make_model(lib, kind, seed)
    model.compile(make_optimizer(lib, spec), "mse")
    return model


def optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def state(model):
    """Everything compared bit for bit: weights, optimizer variables, counters."""
    opt = model.optimizer
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "optimizer": [v.numpy() for v in optimizer_variables(opt)],
        "counters": [int(opt.micro_steps.numpy()), int(opt.iterations.numpy()),
                     int(opt.window_steps.numpy())],
    }


def save_state(path, st):
    arrays = {f"w{i}": w for i, w in enumerate(st["weights"])}
    arrays.update({f"o{i}": v for i, v in enumerate(st["optimizer"])})
    np.savez(path, counters=np.array(st["counters"]), **arrays)


def load_state(path):
    with np.load(path) as f:
        keys = f.files
        return {
            "weights": [f[f"w{i}"] for i in range(sum(k.startswith("w") for k in keys))],
            "optimizer": [f[f"o{i}"] for i in range(sum(k.startswith("o") for k in keys))],
            "counters": list(f["counters"]),
        }


def save(model, fmt, path):
    """Saves `model` (compiled, trained) in `fmt` at `path`."""
    if fmt in ("keras", "h5"):
        model.save(path)
    elif fmt == "savedmodel":
        model.save(path, save_format="tf")
    elif fmt in ("weights", "ckpt"):  # .weights.h5 / TF checkpoint
        model.save_weights(path)
    else:
        raise ValueError(fmt)


def load(job):
    """Loads `job["path"]`: `load_model` for `LOAD_MODEL_FORMATS`, else `load_weights`
    into a freshly built model and optimizer (different initial weights).

    tf_keras SavedModel: `load_model` restores the weights and the compiled
    optimizer's config but not its state (tf_keras's design, every optimizer);
    the state is in the SavedModel's checkpoint, `load_weights(dir/variables/variables)`.
    """
    lib = job["lib"]
    keras = importlib.import_module(lib)
    if job["format"] not in LOAD_MODEL_FORMATS:
        model = compiled_model(lib, job["model"], job["optimizer"], seed=1)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(job["path"])
        return model
    custom_objects = None
    if job.get("custom_objects"):
        from accum import AccumOptimizer

        custom_objects = {"AccumOptimizer": AccumOptimizer}
    model = keras.models.load_model(job["path"], custom_objects=custom_objects)
    if job["format"] == "savedmodel":
        if int(model.optimizer.iterations.numpy()) != 0:
            raise AssertionError("tf_keras's load_model restored the optimizer state: update the docs")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(os.path.join(job["path"], "variables", "variables"))
    elif not model.optimizer._has_window_state():
        # tf_keras legacy optimizers are not saved in `.keras` files (tf_keras
        # saves only new-style optimizers' state there): fresh state.
        model.optimizer.build(model.trainable_variables)
    return model


def run_job(job):
    from accum import AccumOptimizer

    model = load(job)
    if not isinstance(model.optimizer, AccumOptimizer):
        raise AssertionError(f"{job}: loaded optimizer is {type(model.optimizer)}")
    save_state(job["out"] + ".at_load.npz", state(model))
    train(model, STOP, N)
    save_state(job["out"] + ".finished.npz", state(model))


# ------------------------------------------------------------ test side

EXTENSIONS = {"keras": ".keras", "h5": ".h5", "weights": ".weights.h5", "savedmodel": "_savedmodel",
              "ckpt": "_ckpt/ckpt"}


def run_plan(lib, plan, tmp, timeout=600):
    """Test side: for each `(optimizer spec, model kind) -> formats` of `plan`, trains
    `STOP` micro-steps, saves in each format, trains on to `N` (the reference); then
    loads everything in one fresh worker process. Returns `(cases, result)`: `cases`
    maps `(spec, kind, format)` to `(state when saved, reference state, job)`,
    `result` is the worker's report."""
    import subprocess

    cases, jobs = {}, []
    for (spec, kind), formats in plan.items():
        model = compiled_model(lib, kind, spec, seed=0)
        train(model, 0, STOP)
        saved = state(model)
        for fmt in formats:
            name = f"{lib}_{spec}_{kind}_{fmt}"
            path = os.path.join(tmp, name + EXTENSIONS[fmt])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save(model, fmt, path)
            job = dict(lib=lib, optimizer=spec, model=kind, format=fmt, path=path,
                       out=os.path.join(tmp, name), custom_objects=fmt == "keras" and kind == "functional")
            jobs.append(job)
            cases[(spec, kind, fmt)] = [saved, None, job]
        train(model, STOP, N)
        for fmt in formats:
            cases[(spec, kind, fmt)][1] = state(model)
    jobs_file = os.path.join(tmp, "jobs.json")
    with open(jobs_file, "w") as f:
        json.dump(jobs, f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")  # the test process's devices
    env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.save_resume_worker", jobs_file], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(jobs_file + ".result.json") as f:
        return cases, json.load(f)


# On a GPU, two processes may pick different kernels for the same product
# (autotuning), so the resumed run equals the uninterrupted one to float32
# rounding, not bit for bit; on a CPU, bit for bit.
GPU_RTOL = 1e-5


def assert_state_equal(want, got, what):
    """Counters equal; weights and optimizer state bit for bit on a CPU, to `GPU_RTOL` of
    each array's scale where the test process computes on an accelerator."""
    assert want["counters"] == [int(c) for c in got["counters"]], (what, want["counters"], got["counters"])
    exact = accelerator() is None
    for key in ("weights", "optimizer"):
        assert len(want[key]) == len(got[key]), (what, key, len(want[key]), len(got[key]))
        for i, (a, b) in enumerate(zip(want[key], got[key])):
            assert a.shape == b.shape, (what, key, i, a.shape, b.shape)
            if exact:
                assert np.array_equal(a, b), f"{what}: {key}[{i}] differs by {np.max(np.abs(a - b))}"
            else:
                err = max_rel_err(a, b)
                assert err <= GPU_RTOL, f"{what}: {key}[{i}] rel err {err:.3g} > {GPU_RTOL:g} on {accelerator()}"


def check_case(cases, result, case):
    """The job for `case` ran; the state at load is the saved one; the finished run is the reference."""
    saved, reference, job = cases[case]
    prefix = " ".join(map(str, (job["lib"],) + case)) + ": "
    failed = [f for f in result["failures"] if f.startswith(prefix)]
    assert not failed, failed
    assert_state_equal(saved, load_state(job["out"] + ".at_load.npz"), f"{case} at load")
    assert_state_equal(reference, load_state(job["out"] + ".finished.npz"), f"{case} finished")


def main(jobs_file):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with open(jobs_file) as f:
        jobs = json.load(f)
    libs = sorted({job["lib"] for job in jobs})
    for lib in libs:  # as a user program does: `import tf_keras` (or keras), then accum
        importlib.import_module(lib)
    import accum  # noqa: F401  -- registers the AccumOptimizer classes: all a fresh process needs
    import recompute

    recompute.exact_float32()  # as in the test process (tests/conftest.py)

    for lib in libs:
        subclassed_class(lib)
    failures = []
    # `load_model` jobs first, `.h5` first of all: nothing has built an
    # `AccumOptimizer` or loaded a `.keras` file (tf_keras imports the module a
    # `.keras` file names) before them, so they need the registration done by
    # `import accum`.
    jobs.sort(key=lambda job: (job["format"] not in LOAD_MODEL_FORMATS, job["format"] != "h5"))
    for job in jobs:
        # Auto-generated names (`sequential_3`, `dense_7`) differ from the saving
        # process's, as they do when a user resumes in a new program.
        keras = importlib.import_module(job["lib"])
        keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)], name=None)
        try:
            run_job(job)
        except Exception as e:  # report every job, not the first failure only
            failures.append(f"{job['lib']} {job['optimizer']} {job['model']} {job['format']}: "
                            f"{type(e).__name__}: {str(e)[:1500]}")
    with open(jobs_file + ".result.json", "w") as f:
        json.dump({"failures": failures, "tf_keras_imported": "tf_keras" in sys.modules}, f)


if __name__ == "__main__":
    main(sys.argv[1])
