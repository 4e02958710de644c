"""The weight reads of a recomputed training step against the optimizer's writes (both TF families).

The defect (docs/limitations.md, fixed): a block's recomputation reads its
weights in the backward pass; a weight's own gradient does not need that read
(d(xW)/dW = x), only the input gradient does. TensorFlow orders the read before
the optimizer's write of the weight with a control edge (automatic control
dependencies), and Grappler's dependency optimizer removed that edge: its
transitive reduction found a longer path through the one `IdentityN` that joins
every gradient (the default replica context's all-reduce), then bypassed that
`IdentityN`. With nothing ordering them, a read that ran late saw the updated
weight, and the layers below got a wrong gradient in that step.

Two tests, each run by the Keras 3 and the tf_keras suite (its
test_recompute_step_ordering*.py imports them, `__all__`, with its fixture `K`):
- `test_step_graph_orders_every_variable`: in the graph TensorFlow *runs*
  (after Grappler; read from the run metadata, `tensorflow.python.eager.context`,
  private API that has no public equivalent), every two ops on one variable of
  which one writes are ordered by a path. Deterministic: it fails on every run
  of the unfixed code, for the blocks of `test_non_tensor_outputs_in_fit`.
- `test_late_reads_match_reference`: the race itself, made likely -- blocks
  whose recomputation reads the weight only after some work on its input,
  updated before the blocks below them -- trained many steps on TensorFlow's
  inter-op threads against `RECOMPUTE=0`. It failed in 2 or 3 of 6 runs of the
  unfixed code per family (a race: not every run).
"""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.numerics import assert_all_close

_WRITES = ("Assign", "ResourceApply", "ResourceScatter", "ResourceSparseApply", "RngReadAndSkip", "RngSkip",
           "StatefulUniform", "StatefulStandardNormal", "StatefulTruncatedNormal", "StatefulRandomBinomial")
_READS = ("ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape")


def _executed_graph(run):
    """The GraphDef TensorFlow runs (after Grappler) for the largest function that `run()`
    traces and calls for the first time."""
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        run()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    graphs = [g.post_optimization_graph for g in metadata.function_graphs]
    assert graphs, "run() built no function"
    return max(graphs, key=lambda g: len(g.node))


def unordered_pairs(graph_def):
    """`(variable, op, op)` for two ops of `graph_def` on one resource, one of them a write,
    with no path (data or control) between them."""
    nodes = {n.name: n for n in graph_def.node}

    def source(name):
        return name.lstrip("^").split(":")[0]

    def resource_of(node):
        name = source(node.input[0])
        while nodes[name].op == "Identity" and nodes[name].input:
            name = source(nodes[name].input[0])
        return name

    ancestors = {}

    def ancestors_of(name):  # iterative: graphs are deep
        stack = [name]
        while stack:
            top = stack[-1]
            pending = [source(i) for i in nodes[top].input if source(i) not in ancestors]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if top not in ancestors:
                found = set()
                for i in nodes[top].input:
                    found.add(source(i))
                    found |= ancestors[source(i)]
                ancestors[top] = found
        return ancestors[name]

    users = collections.defaultdict(list)
    for node in graph_def.node:
        if node.input and node.op.startswith(_WRITES + _READS):
            users[resource_of(node)].append(node)
    pairs = []
    for variable, ops in users.items():
        for w in (op for op in ops if op.op.startswith(_WRITES)):
            for other in ops:
                if other is not w and other.name not in ancestors_of(w.name) and w.name not in ancestors_of(other.name):
                    pairs.append((variable, other.name, w.name))
    return pairs


def _standard_net(K):
    """Two blocks Dense(tanh) -> Dropout -> Dense, with a residual, under a head
    (the blocks of test_non_tensor_outputs_in_fit, whose recomputation raced)."""

    class Block(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1 = K.layers.Dense(8, activation="tanh")
            self.drop = K.layers.Dropout(0.2)
            self.d2 = K.layers.Dense(8)

        @recompute_grad
        def call(self, x, training=None):
            return self.d2(self.drop(self.d1(x), training=training)) + x

    K.utils.set_random_seed(0)
    inputs = K.Input((8,))
    return K.Model(inputs, K.layers.Dense(1)(Block()(Block()(inputs))))


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_step_graph_orders_every_variable(K, on):
    """In the training step TensorFlow runs (`fit`, SGD), every read of a variable is
    ordered against every write of it, RECOMPUTE on (as off)."""
    x = np.random.RandomState(0).randn(16, 8).astype("float32")
    y = np.random.RandomState(1).randn(16, 1).astype("float32")
    model = _standard_net(K)
    model.compile(K.optimizers.SGD(0.05), "mse")

    def run():
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    pairs = unordered_pairs(_executed_graph(run))
    assert not pairs, f"{len(pairs)} unordered read/write pairs in the executed step: {pairs}"


def _late_read_net(K, blocks):
    class LateRead(K.layers.Layer):
        """y = xW + x, with W read only after some work on x: in the recomputation the
        read waits for the incoming gradient, and W's own gradient (x) does not need it."""

        def __init__(self, seed, **kwargs):
            super().__init__(**kwargs)
            self.seed = seed

        def build(self, shape):
            init = K.initializers.RandomNormal(stddev=0.1, seed=self.seed)
            self.w = self.add_weight(name="w", shape=(shape[-1], shape[-1]), initializer=init)

        @recompute_grad
        def call(self, x):
            work = tf.tile(x, [32, 16])
            for _ in range(4):
                work = tf.tanh(tf.matmul(work, work) / 256.0)
            with tf.control_dependencies([work]):
                w = tf.identity(self.w)
            return tf.matmul(x, w) + x

    class Net(K.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # Called top first: the top block's weight comes first among the
            # model's weights, so the optimizer may update it before the blocks
            # below have their gradients (which need its read).
            self.stack = [LateRead(i + 1) for i in range(blocks)]
            self.head = K.layers.Dense(1, kernel_initializer=K.initializers.RandomNormal(stddev=0.1, seed=0))

        def call(self, x):
            for block in reversed(self.stack):
                x = block(x)
            return self.head(x)

    return Net()


@pytest.mark.slow
def test_late_reads_match_reference(K, epochs=40):
    """`fit` with recomputation ends at RECOMPUTE=0's weights (≤ 1e-6) when the recomputation
    reads its weights late, step after step on TensorFlow's inter-op threads."""
    assert tf.config.threading.get_inter_op_parallelism_threads() != 1 and (os.cpu_count() or 1) > 1
    x = np.random.RandomState(0).randn(64, 16).astype("float32")
    y = np.random.RandomState(1).randn(64, 1).astype("float32")
    weights = []
    for on in (False, True):
        model = _late_read_net(K, blocks=6)
        model.compile(K.optimizers.SGD(0.01), "mse")
        with recompute.recompute_scope(on):
            model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        weights.append([np.asarray(v) for v in model.trainable_variables])
    assert_all_close(weights[0], weights[1], rtol=1e-6)


__all__ = [name for name in dir() if name.startswith("test_")]  # what the suites import
