"""Keras 3 on the JAX backend for this suite (see tests.helpers.jax_backend)."""

from tests.helpers.jax_backend import use_jax

use_jax()
