"""Models and loops shared by the `recompute_grad` tests under `tf.distribute`: the
in-process `MirroredStrategy` tests of both families and the `MultiWorkerMirroredStrategy`
worker (`mwms_recompute_worker.py`).

The block: Dense-GELU, Dropout, Dense, residual, BatchNormalization (moving
statistics updated in the forward pass). Each family's block counts its calls
in `CALLS`, so a test can see that the recomputation ran.
"""

import numpy as np
import tensorflow as tf

import recompute

UNITS, DEPTH = 8, 2
CALLS = {"n": 0}


def block_model(K, seed=0):
    """`DEPTH` blocks and a Dense head, in the family `K` (`keras` or `tf_keras`). tf_keras
    needs `tf_keras.backend.experimental.enable_tf_random_generator()` for dropout
    masks identical to a run without recomputation."""
    from recompute import recompute_grad

    L = K.layers

    class Block(L.Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.d1 = L.Dense(units * 2, activation="gelu")
            self.drop = L.Dropout(0.3)
            self.d2 = L.Dense(units)
            self.bn = L.BatchNormalization(momentum=0.5)

        @recompute_grad
        def call(self, x, training=None):
            CALLS["n"] += 1
            h = self.d2(self.drop(self.d1(x), training=training))
            return self.bn(x + h, training=training)

    K.utils.set_random_seed(seed)
    inp = K.Input((UNITS,))
    h = inp
    for _ in range(DEPTH):
        h = Block(UNITS)(h)
    return K.Model(inp, L.Dense(1)(h))


def unused_model(keras_module, seed=0, units=UNITS, features=UNITS):
    """A block whose output uses neither its second input `aux` nor its `unused` sublayer:
    the weights of both get no gradient (None), with or without recomputation.
    Returns the model and those unconnected weights (`aux`'s, then `unused`'s)."""
    from recompute import recompute_grad

    L = keras_module.layers

    class UnusedBlock(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.used = L.Dense(units, activation="tanh")
            self.unused = L.Dense(units, name="unused")

        def build(self, input_shape):
            self.used.build(input_shape[0])
            self.unused.build(input_shape[0])
            super().build(input_shape)

        @recompute_grad
        def call(self, inputs):
            CALLS["n"] += 1
            x, aux = inputs
            return self.used(x)

    keras_module.utils.set_random_seed(seed)
    inp = L.Input((features,))
    aux = L.Dense(units, name="aux")(inp)  # reaches the output only through `aux`
    block = UnusedBlock(name="block")
    model = keras_module.Model(inp, L.Dense(1)(block([L.Dense(units)(inp), aux])))
    return model, model.get_layer("aux").weights + block.unused.weights


def data(n, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, UNITS).astype("float32"), rng.randn(n, 1).astype("float32")


def local(strategy, value):
    """This process's per-replica values of `value` (a variable, Keras 3 or not, or a result)."""
    if not isinstance(value, (tf.Variable, tf.Tensor, tf.distribute.DistributedValues)):
        value = value.value  # a Keras 3 variable: its tf.Variable
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def state(strategy, model):
    """Every replica's copy of every weight, moving statistic and RNG state (seeds of
    Keras 3 `SeedGenerator`s are weights; tf_keras's `tf.random.Generator`s are not)."""
    variables = list(model.weights)
    for layer in getattr(model, "submodules", ()):  # tf_keras
        generator = getattr(getattr(layer, "_random_generator", None), "_generator", None)
        if isinstance(generator, tf.random.Generator):
            variables.append(generator.state)
    return [a for v in variables for a in local(strategy, v)]


def custom_loop(strategy, model, optimizer, batches, global_batch):
    """`strategy.run` in `tf.function`: gradients of the inputs and of every weight (each
    replica's own, before the all-reduce), then SGD. Returns the last step's gradients,
    every local replica's, in order."""

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, [x] + model.trainable_variables)
        optimizer.apply_gradients(zip(grads[1:], model.trainable_variables))
        return grads

    @tf.function
    def step(x, y):
        return strategy.run(replica_step, args=(x, y))

    for x, y in batches:
        grads = step(x, y)
    return [a for g in grads for a in local(strategy, g)]


def run_custom_loop(strategy, make_model, make_optimizer, batches, global_batch, on):
    """Builds the model and optimizer under `strategy` and runs `custom_loop` with
    recomputation `on` or off. Returns (gradients, state, block calls)."""
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer()
    CALLS["n"] = 0
    with recompute.recompute_scope(on):
        grads = custom_loop(strategy, model, optimizer, batches, global_batch)
    return grads, state(strategy, model), CALLS["n"]
