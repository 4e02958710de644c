"""Full float32 matrix products on GPUs: `exact_float32`.

NVIDIA GPUs since Ampere multiply float32 matrices in TF32 by default -- in
TensorFlow and in JAX/XLA alike -- with a 10-bit mantissa instead of 23. A
model with recomputation, or an accumulating optimizer, then equals its
reference (the same model without recomputation; the inner optimizer at batch
k·b) only to TF32 rounding, about 1e-3 relative, because the two sides round
their products differently. With float32 pinned, they equal it to the
tolerances this project documents and tests (docs/exactness.md).
"""

import sys

import tensorflow as tf

_JAX_OPTION = "jax_default_matmul_precision"


def _jax():
    """JAX's module if this process has imported it (Keras's JAX backend does), else None."""
    return sys.modules.get("jax")


class exact_float32:
    """Pins float32 matrix products and convolutions to full float32 precision.

    Turns TF32 off in TensorFlow
    (`tf.config.experimental.enable_tensor_float_32_execution(False)`) and,
    when JAX is imported (Keras on the JAX backend imports it), sets JAX's
    default matmul precision to `"highest"` (float32). As a statement it holds
    for the rest of the process; as a context manager, until the block ends,
    when both settings return to what they were.

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
    scope inside the code wins. JAX imported only after this call keeps its
    default: call it after `import keras` (or `import jax`). Reduced-precision
    dtypes (float16, bfloat16) are not affected.
    """

    def __init__(self):
        self._previous_tf = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(False)
        jax = _jax()
        self._previous_jax = None
        if jax is not None:
            self._previous_jax = (getattr(jax.config, _JAX_OPTION),)
            jax.config.update(_JAX_OPTION, "highest")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        tf.config.experimental.enable_tensor_float_32_execution(self._previous_tf)
        if self._previous_jax is not None:
            _jax().config.update(_JAX_OPTION, self._previous_jax[0])
        return False

    def __repr__(self):
        return "exact_float32()"
