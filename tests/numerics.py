"""Comparison helpers shared by the test suites (NumPy and TensorFlow only)."""

import numpy as np

RTOL = 1e-5


def max_rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = max(np.max(np.abs(a)) if a.size else 0.0, 1e-30)
    return float(np.max(np.abs(a - b)) / scale) if a.size else 0.0


def assert_all_close(reference, actual, names=None, rtol=RTOL):
    """Every array of `actual` equals its `reference` to `rtol` relative to its scale."""
    assert len(reference) == len(actual), (len(reference), len(actual))
    names = names or [str(i) for i in range(len(reference))]
    bad = []
    for name, ref, got in zip(names, reference, actual):
        assert ref is not None and got is not None, f"missing gradient for {name}"
        ref, got = np.asarray(ref), np.asarray(got)
        assert ref.shape == got.shape, (name, ref.shape, got.shape)
        err = max_rel_err(ref, got)
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
