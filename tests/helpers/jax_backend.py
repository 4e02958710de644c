"""The JAX-backend suites (`tests/recompute_jax`, `tests/accum_jax`) run in a pytest process of
their own with `KERAS_BACKEND=jax` in the environment (README's test command sets it): Keras
reads it when first imported, which `import tensorflow` in tests/conftest.py already does."""


def use_jax():
    """Raises `pytest.UsageError` unless Keras runs on the JAX backend (each suite's conftest.py)."""
    import keras
    import pytest

    if keras.backend.backend() != "jax":
        raise pytest.UsageError(
            "tests/recompute_jax and tests/accum_jax run Keras 3 on the JAX backend, in a "
            "pytest process of their own: `KERAS_BACKEND=jax python -m pytest "
            "tests/recompute_jax tests/accum_jax`. Received: Keras on the "
            f"{keras.backend.backend()!r} backend."
        )


def jaxprs(jaxpr):
    """`jaxpr` and every jaxpr nested in its equations' parameters (scan and loop bodies,
    `jax.checkpoint`, `custom_vjp`, ...), depth first."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxprs(inner)
