"""Keras 3 on a backend other than TensorFlow and JAX: both packages refuse at once, naming
the backend (the JAX backend is tested in tests/recompute_jax and tests/accum_jax).

PyTorch is not installed (it would bring CUDA libraries), so the backend Keras
reports is replaced for the test (`keras.backend.backend`, which both packages ask).
"""

import keras
import pytest

import recompute
from accum import AccumOptimizer


@pytest.fixture(params=["torch", "numpy"])
def other_backend(monkeypatch, request):
    monkeypatch.setattr(keras.backend, "backend", lambda: request.param)
    return request.param


def test_accum_refuses_at_construction(other_backend):
    with pytest.raises(NotImplementedError, match=f"TensorFlow or JAX backend. Received: an optimizer of the '{other_backend}' backend"):
        AccumOptimizer(keras.optimizers.Adam(), 4)


def test_recompute_refuses_at_decoration(other_backend, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "tf_keras", raising=False)  # only Keras 3 in the process
    with pytest.raises(NotImplementedError, match=f"Received: `.*call` decorated on the '{other_backend}' backend"):

        class Block(keras.layers.Layer):
            @recompute.recompute_grad
            def call(self, x):
                return x


def test_recompute_refuses_a_bound_call_at_decoration(other_backend):
    layer = keras.layers.Dense(2)
    with pytest.raises(NotImplementedError, match=f"layer '{layer.name}' running on the '{other_backend}' backend"):
        layer.call = recompute.recompute_grad(layer.call)


def test_tensorflow_backend_is_accepted():
    AccumOptimizer(keras.optimizers.Adam(), 4)

    class Block(keras.layers.Layer):
        @recompute.recompute_grad
        def call(self, x):
            return x
