"""recompute_grad on Keras 3: the graph keeps only what it should (recomputed random ops wait for the gradient)."""

import keras
import tensorflow as tf

from recompute import recompute_grad
from tests.helpers.attention_blocks import ancestors
from tests.helpers.recompute_runs import gradient_graph


class MaskBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)
        self.drop = keras.layers.Dropout(0.5)

    @recompute_grad
    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


def test_recomputed_random_ops_wait_for_the_gradient():
    """Memory: a recomputed dropout mask is drawn in the backward pass, not kept from the forward."""
    blocks = [MaskBlock(), MaskBlock()]
    x = tf.ones([2, 8])
    for b in blocks:
        b(x)
    graph = gradient_graph(blocks, x)  # traced with recomputation on
    loss_grad = [op for op in graph.get_operations() if op.name.startswith("gradient_tape/")]
    assert loss_grad
    random_ops = [op for op in graph.get_operations()
                  if op.type.startswith("StatelessRandom") and "KeyCounter" not in op.type]
    # Forward draws: 2; recomputed draws: 2 (created after the first gradient op).
    first_grad = graph.get_operations().index(loss_grad[0])
    recomputed = [op for op in random_ops if graph.get_operations().index(op) > first_grad]
    assert len(recomputed) == 2

    for op in recomputed:
        assert any(name.startswith("gradient_tape/") for name in ancestors(op)), op.name
