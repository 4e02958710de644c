"""Settings every suite shares, made before any test module imports TensorFlow's devices.

- GPUs stay visible: the suites run on whatever device is there. Hide it with
  `CUDA_VISIBLE_DEVICES=""` to test on the CPU.
- Float32 is pinned for the whole run (`recompute.exact_float32()`: no TF32 in
  TensorFlow, JAX's matmul precision "highest"), and GPU kernels are
  deterministic (XLA's `--xla_gpu_deterministic_ops=true`; TensorFlow's op
  determinism where TensorFlow sees a GPU), so the tolerances the
  tests compare at hold on a GPU as on a CPU. XLA's LLVM backend runs at -O2
  (`--xla_backend_optimization_level=2`: compile time, below). Workers the tests start in
  fresh processes inherit the devices and `XLA_FLAGS`, and pin float32
  themselves (`tests/helpers/save_resume_worker.py`).
- Two logical CPU devices, for the `MirroredStrategy` tests of every suite.
- `KTM_FAST_TESTS=1` runs the fast subset (`.ci/run` does so on every Python but the
  newest, whose run has every test): the tests marked `fast`, the first case of each (a
  case marked alone: that case) -- a few seconds each, in every suite: recompute and
  accumulation exact against their references, each backend and family, keras-hub, bert4keras,
  the planner, README's examples. Every test module (and what it imports of the library)
  still loads on that Python, at collection; the behaviour itself is tested by the newest
  Python's full run.
- The full run hands out the longest test files first, each file whole, so that under
  `-n 2 --dist loadfile` no long file starts last and runs alone: a file's weight is the sum
  of the `seconds` its tests' `slow` marks estimate (`@pytest.mark.slow(seconds=250)`, per
  test -- per case of a parametrized one, and a module's `pytestmark` gives each of its tests
  its estimate -- on 2 shared CPU cores), then its number of tests (pytest-xdist's own order,
  which it would otherwise impose: `--loadscope-reorder`, turned off here).
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The [test] extra installs JAX's CUDA plugin (for benchmarks.gpu_plan): without a CUDA
# runtime its version check prints a traceback at JAX's start; skipping it, JAX starts on
# whatever devices there are, as before.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# XLA's flags for every process of the run (fresh processes the tests start inherit them):
# deterministic GPU kernels, and XLA's LLVM backend at -O2 (`--xla_backend_optimization_level=2`;
# the default is 3). The tests' programs are tiny and each is compiled about once, so LLVM's
# optimization was much of the JAX suite's time: a 2-block attention step's loss and gradients
# on XLA:CPU took 10.7 CPU s to compile at 3, 4.2 at 2, 2.3 at 0 (with recomputation 14.6, 7.0,
# 5.2; 2026-11-30). It changes no HLO pass: fusion, buffer assignment and so every memory plan
# the tests compare are the same (an XLA:GPU plan row: 16,790,696 temp bytes at 3 and at 0).
# Not 0: at 0 the feed-forward pair's loss differed from the layers' by 8.6e-6 (relative; 1e-6
# allowed) -- LLVM's math at 0 is not the optimized levels' -- while at 1, 2 and 3 they agree.
# TensorFlow's XLA compiles (`jit_compile=True`) took as long either way.
for _flag in ("--xla_gpu_deterministic_ops=true", "--xla_backend_optimization_level=2"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

FAST_TESTS = "KTM_FAST_TESTS"


def _two_logical_cpus():
    """Two logical CPU devices, for the `MirroredStrategy` tests of every suite.

    Set here, before any test module initializes TensorFlow's devices, so that
    each suite runs on its own (`pytest tests/recompute_keras3` alone runs its
    distribution tests too).
    """
    import tensorflow as tf

    try:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # already initialized by the importer: the distribution tests say so
        pass


def _pin_float32():
    """Float32 products everywhere; on a TensorFlow GPU also TensorFlow's deterministic kernels
    (where a test claims bit-exactness within a process; with a global seed, which
    determinism requires of unseeded random ops)."""
    if os.environ.get("KERAS_BACKEND") == "jax":
        import jax  # noqa: F401  -- so that exact_float32 pins JAX's precision too
    import tensorflow as tf

    import recompute

    recompute.exact_float32()
    if tf.config.list_physical_devices("GPU"):
        tf.config.experimental.enable_op_determinism()
        tf.random.set_seed(0)


_two_logical_cpus()
_pin_float32()


@pytest.fixture
def blocked_core():
    """The blocked attention core named (`recompute.attention_core("blocked")`), for the tests
    of that core: at their short sequences the rule ("auto", `recompute.ops._flash.runs_blocked`)
    runs the layer's own core on TensorFlow (up to 512 keys). Use it as
    `@pytest.mark.usefixtures("blocked_core")` or a module's `pytestmark`."""
    import recompute

    with recompute.attention_core("blocked"):
        yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"slow(seconds=N): a long test (benchmark-like or many processes), about N s per "
        f"case on 2 shared CPU cores where given (the full run's order); not in the {FAST_TESTS}=1 subset"
    )
    config.addinivalue_line(
        "markers", f"fast: in the {FAST_TESTS}=1 subset (its first case; a case marked alone: that "
        "case); a few seconds at most"
    )
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def _test_file(item):
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FAST_TESTS, "") not in ("1", "true", "yes"):
        # The longest files first, each whole and in its order: with `-n 2 --dist loadfile`
        # the short ones fill in, instead of one long file running alone at the end (the
        # JAX suite's XLA:GPU plans did, for minutes). Which files precede a file on a
        # worker was never fixed.
        seconds, count = {}, {}
        for item in items:
            path, mark = _test_file(item), item.get_closest_marker("slow")
            seconds[path] = seconds.get(path, 0) + (mark.kwargs.get("seconds", 0) if mark else 0)
            count[path] = count.get(path, 0) + 1
        items.sort(key=lambda item: (-seconds[_test_file(item)], -count[_test_file(item)]))
        return
    kept, left_out, seen = [], [], set()
    for item in items:
        function = (_test_file(item), getattr(item, "originalname", item.name))
        if item.get_closest_marker("fast") is None or function in seen:
            left_out.append(item)
        else:
            seen.add(function)
            kept.append(item)
    if left_out:
        items[:] = kept
        config.hook.pytest_deselected(items=left_out)


def pytest_report_header(config):
    fast = os.environ.get(FAST_TESTS, "") in ("1", "true", "yes")
    return (f"{FAST_TESTS}={'1: the tests marked fast, one case each' if fast else 'unset: every test'}; "
            "float32 pinned (recompute.exact_float32)")


@pytest.fixture(scope="session")
def mirrored_strategy():
    """The one `MirroredStrategy` on the 2 logical CPUs (configured by the suites'
    conftest.py) that every test module of this process uses.

    Each strategy numbers its collective ops from the same keys, so two of them
    in one process would run collectives whose keys clash ("Shape mismatch in
    the collective instance"), e.g. tests/recompute_keras3 followed by tests/accum_keras3.
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
