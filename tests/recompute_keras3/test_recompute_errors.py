"""recompute_grad on Keras 3: what it refuses, with errors that say what was expected and received."""

import keras
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close, to_numpy
from tests.helpers.k3_blocks import Block, inputs
from tests.helpers.recompute_runs import check_variable_creation_refused


class LazyBlock(keras.layers.Layer):
    """Creates a variable only on its second call: the recomputation would create it."""

    def __init__(self, make_variable, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.make_variable = make_variable

    def build(self, input_shape):
        pass

    @recompute_grad
    def call(self, x):
        self.calls += 1
        if self.calls > 1:
            return x * self.make_variable()
        return x * 2.0


@pytest.mark.parametrize(
    "make_variable",
    [lambda: keras.Variable(2.0), lambda: tf.Variable(2.0)],
    ids=["keras.Variable", "tf.Variable"],
)
def test_variable_created_in_recomputation_raises(make_variable):
    check_variable_creation_refused(LazyBlock(make_variable), inputs((2, 3)))


def test_forward_mode_autodiff_raises():
    layer = Block(8)
    x = inputs()
    layer(x)
    with recompute.recompute_scope(True):
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)):
            with pytest.raises(NotImplementedError, match="ForwardAccumulator"):
                layer(x, training=True)


def test_decorating_wrong_things_raises():
    with pytest.raises(TypeError, match="Received: .*Dense"):
        recompute_grad(keras.layers.Dense(2))
    with pytest.raises(TypeError, match="Received"):
        recompute_grad(keras.layers.Dense)
    with pytest.raises(TypeError, match="named 'forward'"):

        @recompute_grad
        def forward(self, x):
            return x

    class NotALayer:
        @recompute_grad
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="Received: a call on .*NotALayer"):
        NotALayer().call(tf.ones(2))


def test_bound_call_of_an_instance():
    x = inputs()
    results = []
    for on in (False, True):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(3)
        layer(x)
        layer.call = recompute_grad(layer.call)
        with recompute.recompute_scope(on):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x) ** 2)
        results.append(to_numpy(tape.gradient(loss, [x] + layer.trainable_variables)))
    assert_all_close(results[0], results[1])


def test_non_tensorflow_backend_raises(monkeypatch):
    # JAX is tested in tests/recompute_jax; PyTorch is not installed (it would
    # bring CUDA libraries), so the backend Keras reports is patched for this test.
    layer = Block(8)
    x = inputs()
    layer(x)
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with recompute.recompute_scope(True):
        with pytest.raises(NotImplementedError, match="'torch' backend"):
            layer(x)
    with recompute.recompute_scope(False):
        layer(x)  # off: the original call runs, whatever the backend


class OffloadedBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    @recompute_grad(offload=True)
    def call(self, x):
        return self.dense(x)


def test_offload_is_refused_on_tensorflow_at_a_recomputed_call():
    layer = OffloadedBlock()
    x = tf.ones((2, 4))
    layer(x)  # no tape: runs as written
    with recompute.recompute_scope(True), tf.GradientTape() as tape:
        with pytest.raises(ValueError, match="TensorFlow has no host offload"):
            layer(x)
    with recompute.recompute_scope(False), tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)  # RECOMPUTE off: nothing recomputed, nothing refused
    assert tape.gradient(y, x) is not None


def test_offload_with_attention_policy_is_refused_at_decoration():
    with pytest.raises(ValueError, match='policy="full" only'):
        recompute_grad(policy="attention", offload=True)
