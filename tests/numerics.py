"""Comparison helpers shared by the test suites (NumPy and TensorFlow only)."""

import numpy as np

RTOL = 1e-5


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
