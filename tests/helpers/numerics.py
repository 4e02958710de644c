"""Comparison helpers shared by the test suites (NumPy and TensorFlow only)."""

import numpy as np

RTOL = 1e-5


def accelerator():
    """The accelerator Keras computes on in this process ("gpu", "tpu"), or None on a CPU.

    JAX backend: JAX's default backend. TensorFlow: a visible GPU. Tests that
    compare bit for bit across processes do so on a CPU only (autotuned GPU
    kernels may differ from process to process); on an accelerator they check
    a tolerance and say so.
    """
    import os

    if os.environ.get("KERAS_BACKEND") == "jax":
        import jax

        return None if jax.default_backend() == "cpu" else jax.default_backend()
    import tensorflow as tf

    return "gpu" if tf.config.list_logical_devices("GPU") else None


def max_rel_err(a, b, floor=0.0):
    """max |a - b| relative to max(max |a|, floor)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not a.size:
        return 0.0
    scale = max(float(np.max(np.abs(a))), floor, 1e-30)
    return float(np.max(np.abs(a - b)) / scale)


def assert_all_close(reference, actual, names=None, rtol=RTOL):
    """Every array of `actual` equals its `reference` to `rtol`.

    The error of each array is taken relative to its own scale, or to a tenth
    of the largest value among all arrays if that is larger: a gradient that is
    analytically zero (a bias feeding a batch normalization, say) is a sum of
    rounding errors in both runs, and dividing by it would compare noise.
    Anything wrong by more than 1e-6 of the largest gradient still fails.
    """
    assert len(reference) == len(actual), (len(reference), len(actual))
    names = names or [str(i) for i in range(len(reference))]
    for name, ref, got in zip(names, reference, actual):
        assert ref is not None and got is not None, f"missing gradient for {name}"
        assert np.shape(ref) == np.shape(got), (name, np.shape(ref), np.shape(got))
    floor = 0.1 * max(float(np.max(np.abs(np.asarray(r, np.float64)))) for r in reference if np.size(r))
    bad = []
    for name, ref, got in zip(names, reference, actual):
        err = max_rel_err(ref, got, floor)
        if not err <= rtol:
            bad.append(f"{name}: rel err {err:.3g}")
    assert not bad, "; ".join(bad)


def to_numpy(values):
    out = []
    for v in values:
        if v is None:
            out.append(None)
        elif hasattr(v, "values") and hasattr(v, "indices") and hasattr(v, "dense_shape"):
            import tensorflow as tf

            out.append(tf.convert_to_tensor(v).numpy())
        else:
            out.append(np.asarray(v))
    return out


def assert_state_equal(reference, actual):
    """RNG states (integers) equal exactly; moving statistics (floats) to `RTOL` of their scale."""
    assert len(reference) == len(actual), (len(reference), len(actual))
    for ref, got in zip(reference, actual):
        ref, got = np.asarray(ref), np.asarray(got)
        if np.issubdtype(ref.dtype, np.integer):
            np.testing.assert_array_equal(got, ref)
        else:
            assert max_rel_err(ref, got) <= RTOL, (ref, got)


def worst_rel_err(reference, actual, names=None):
    """(name, error) of the worst array: max |a - b| over that array's own max |a|."""
    assert len(reference) == len(actual), (len(reference), len(actual))
    names = names or [str(i) for i in range(len(reference))]
    worst = ("", 0.0)
    for name, ref, got in zip(names, reference, actual):
        assert np.shape(ref) == np.shape(got), (name, np.shape(ref), np.shape(got))
        err = max_rel_err(ref, got)
        if not err <= worst[1]:
            worst = (name, err)
    return worst


def assert_each_close(reference, actual, tol, names=None):
    """Every array of `actual` equals its reference to `tol`, relative to its own scale.

    Stricter than `assert_all_close`: a small array (an Adam second moment, say)
    is judged against its own magnitude, not the largest array's.
    """
    name, err = worst_rel_err(reference, actual, names)
    assert err <= tol, f"{name}: rel err {err:.3g} > {tol:g}"


def assert_grouped_close(reference, actual, tol, names, group_of, floor_fraction=0.1):
    """Every array equals its reference to `tol`, relative to its own scale or, if
    larger, `floor_fraction` of the largest scale in its group (`group_of(name)`).

    Groups keep the floor meaningful for state of very different magnitudes
    (weights, first moments, second moments): an array whose entries are all
    near zero (a bias's momentum) is a sum of rounding errors in both runs and
    is judged against its group, while an Adam second moment is not judged
    against the weights.
    """
    assert len(reference) == len(actual) == len(names), (len(reference), len(actual), len(names))
    scales = {}
    for name, ref in zip(names, reference):
        s = float(np.max(np.abs(np.asarray(ref, np.float64)))) if np.size(ref) else 0.0
        g = group_of(name)
        scales[g] = max(scales.get(g, 0.0), s)
    bad = []
    for name, ref, got in zip(names, reference, actual):
        assert np.shape(ref) == np.shape(got), (name, np.shape(ref), np.shape(got))
        err = max_rel_err(ref, got, floor_fraction * scales[group_of(name)])
        if not err <= tol:
            bad.append(f"{name}: rel err {err:.3g}")
    assert not bad, f"> {tol:g}: " + "; ".join(bad)


def check_exact_float32():
    """`recompute.exact_float32()` turns TF32 off in TensorFlow and sets JAX's default matmul
    precision to "highest"; as a context manager it applies at each entry and restores, on
    exit, what was in force when its block was entered (one object serves two blocks; an
    object made earlier never undoes a later statement)."""
    import sys

    import tensorflow as tf

    import recompute

    jax = sys.modules.get("jax")
    assert jax is not None  # TensorFlow imports JAX: there is no "JAX imported later"

    def settings():
        return (tf.config.experimental.tensor_float_32_execution_enabled(),
                jax.config.jax_default_matmul_precision)

    def defaults():
        tf.config.experimental.enable_tensor_float_32_execution(True)  # TensorFlow's default
        jax.config.update("jax_default_matmul_precision", None)  # JAX's default

    pinned = (False, "highest")
    defaults()
    try:
        default = settings()
        with recompute.exact_float32() as scope:
            assert settings() == pinned
            assert repr(scope) == "exact_float32()"
        assert settings() == default
        # one object, two blocks: the second runs pinned too, and both restore the default
        for _ in range(2):
            with scope:
                assert settings() == pinned
            assert settings() == default
        # made earlier, entered after a later statement: exit keeps the statement's setting
        earlier = recompute.exact_float32()
        defaults()
        recompute.exact_float32()  # a statement: for the rest of the process
        with earlier:
            assert settings() == pinned
        assert settings() == pinned
        # nested entries of one object restore in reverse order
        defaults()
        with scope:
            defaults()
            with scope:
                assert settings() == pinned
            assert settings() == default
        assert settings() == default
        recompute.exact_float32()  # a statement: for the rest of the process
        assert settings() == pinned
    finally:
        recompute.exact_float32()  # as tests/conftest.py leaves it
