"""Full float32 matrix products on GPUs: `exact_float32`.

NVIDIA GPUs since Ampere multiply float32 matrices in TF32 by default -- in
TensorFlow and in JAX/XLA alike -- with a 10-bit mantissa instead of 23. A
model with recomputation, or an accumulating optimizer, then equals its
reference (the same model without recomputation; the inner optimizer at batch
k·b) only to TF32 rounding, about 1e-3 relative, because the two sides round
their products differently. With float32 pinned, they equal it to the
tolerances this project documents and tests (docs/exactness.md).
"""

import tensorflow as tf

from ._setting import Setting

_JAX_OPTION = "jax_default_matmul_precision"


def _jax():
    """JAX's module if it is installed (TensorFlow 2.21 imports it already), else None."""
    try:
        import jax
    except ImportError:
        return None
    return jax


class exact_float32(Setting):
    """Pins float32 matrix products and convolutions to full float32 precision.

    Turns TF32 off in TensorFlow
    (`tf.config.experimental.enable_tensor_float_32_execution(False)`) and,
    where JAX is installed, sets JAX's default matmul precision to
    `"highest"` (float32). As a statement it holds for the rest of the
    process. As a context manager it holds inside the block and applies
    again at each entry (one object can serve several blocks); on exit both
    settings return to what they were when the block was entered (for
    `with exact_float32():`, before it was made), so a scope never undoes a
    later `exact_float32()` statement.

    ```python
    import recompute
    recompute.exact_float32()            # from here on
    with recompute.exact_float32():      # or inside the block only
        model.fit(x, y)
    ```

    On a CPU nothing changes (CPUs have no TF32). On a GPU, products run at
    full float32 speed instead of TF32 tensor-core speed (several times slower
    for large matrices). Limits: JAX reads its setting when a function is
    traced (it is part of `jax.jit`'s cache key, so jitted functions retrace);
    an explicit `precision=` argument or a `jax.default_matmul_precision`
    scope inside the code wins. Reduced-precision dtypes (float16, bfloat16)
    are not affected.
    """

    def _read(self):
        jax = _jax()
        return (tf.config.experimental.tensor_float_32_execution_enabled(),
                None if jax is None else getattr(jax.config, _JAX_OPTION))

    def _write(self, state):
        tf.config.experimental.enable_tensor_float_32_execution(state[0])
        jax = _jax()
        if jax is not None:
            jax.config.update(_JAX_OPTION, state[1])

    def _wanted(self):
        return (False, None if _jax() is None else "highest")

    def __repr__(self):
        return "exact_float32()"
