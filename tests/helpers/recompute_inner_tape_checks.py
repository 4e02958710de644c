"""recompute_grad checks for both Keras families: calls that open their own GradientTape
(D4) and RNN cells (D6). `K` (fixture, tests.helpers.families) is `keras` or `tf_keras`;
tests/recompute_keras3/test_recompute_inner_tape.py and
tests/recompute_tf_keras/test_recompute_inner_tape_tf_keras.py import the tests.

D4: forces = -dE/dx computed with a tape inside the decorated call must equal
the plain run's, and so must every gradient (they need the second derivative
through the inner tape), in `tf.function` and `fit`. In eager mode such a call
is refused with a clear error (its tape could not record there).
D6: a decorated cell in `K.layers.RNN(unroll=False)` runs inside a
`tf.while_loop` body in graph mode: refused with a clear error; decorating the
RNN layer itself, or `unroll=True`, is exact.
"""

import functools
import types

import numpy as np
import pytest
import tensorflow as tf

import recompute
from recompute import recompute_grad
from tests.helpers.families import is_tf_keras, ops_concatenate, ops_sum, variable_name
from tests.helpers.numerics import assert_all_close, to_numpy
from tests.helpers.recompute_runs import loss_and_gradients

HiddenTape = tf.GradientTape  # a name the check of the call's code does not follow


def forces_of(energy, x):
    with tf.GradientTape() as t:
        t.watch(x)
        e = energy(tf.tanh(x))
    return -t.gradient(e, x)


def cubes(h):
    return tf.reduce_sum(h**3, -1, keepdims=True)


@functools.cache
def layers(K):
    """The layers of the checks, as classes of the family `K`."""

    class Forces(K.layers.Layer):
        """Energy net E(x); returns the forces -dE/dx, computed with a tape of its own."""

        def __init__(self, kind="plain", **kwargs):
            super().__init__(**kwargs)
            self.kind = kind
            self.e1 = K.layers.Dense(16, activation="tanh")
            self.e2 = K.layers.Dense(16, activation="softplus")
            # No bias on the energy head: it would not reach the forces (no gradient at all).
            self.e3 = K.layers.Dense(1, use_bias=False)

        def energy(self, x):
            return self.e3(self.e2(self.e1(x)))

        @recompute_grad
        def call(self, x):
            if self.kind == "persistent":
                with tf.GradientTape(persistent=True) as t:
                    t.watch(x)
                    e = self.energy(x)
                    e2 = tf.reduce_sum(e**2)
                forces = -t.gradient(e, x) + 0.1 * t.gradient(e2, x)
                del t
            elif self.kind == "watch_x_only":
                with tf.GradientTape(watch_accessed_variables=False) as t:
                    t.watch(x)
                    e = self.energy(x)
                forces = -t.gradient(e, x)
            else:
                with tf.GradientTape() as t:
                    t.watch(x)
                    e = self.energy(x)
                forces = -t.gradient(e, x)
            return forces

    class ForcesInMethod(K.layers.Layer):
        """Opens its tape in a helper method that `call` calls."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.e = K.layers.Dense(1, use_bias=False)

        def forces(self, x):
            with tf.GradientTape() as t:
                t.watch(x)
                e = self.e(tf.tanh(x))
            return -t.gradient(e, x)

        @recompute_grad
        def call(self, x):
            return self.forces(x)

    class ForcesInFunction(ForcesInMethod):
        """Opens its tape in a module-level function that `call` calls."""

        @recompute_grad
        def call(self, x):
            return forces_of(self.e, x)

    class TapeSublayer(ForcesInMethod):
        """An undecorated layer that opens a tape in its `call`."""

        def call(self, x):
            return self.forces(x)

    class Holder(K.layers.Layer):
        """A decorated call whose sublayer opens the tape."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = TapeSublayer()
            self.d = K.layers.Dense(3)

        @recompute_grad
        def call(self, x):
            return self.d(self.inner(x))

    class LambdaHolder(K.layers.Layer):
        """A decorated call whose `Lambda` sublayer opens the tape (or, `tape=False`, does not)."""

        def __init__(self, tape=True, **kwargs):
            super().__init__(**kwargs)
            if tape:
                self.inner = K.layers.Lambda(lambda x: forces_of(cubes, x))
            else:
                self.inner = K.layers.Lambda(lambda x: tf.tanh(x) ** 3)
            self.d = K.layers.Dense(3)

        @recompute_grad
        def call(self, x):
            return self.d(self.inner(x))

    class ForcesUnderAlias(ForcesInMethod):
        @recompute_grad
        def call(self, x):
            with HiddenTape() as t:
                t.watch(x)
                e = self.e(tf.tanh(x))
            return -t.gradient(e, x)

    concatenate = ops_concatenate(K)

    class Cell(K.layers.Layer):
        def __init__(self, units, decorate=True, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.state_size = units
            self.decorate = decorate
            self.d = K.layers.Dense(units, activation="tanh")

        def build(self, input_shape):
            self.d.build((input_shape[0], input_shape[-1] + self.units))
            if is_tf_keras(K):
                self.built = True

        def step(self, x, states):
            h = self.d(concatenate([x, states[0]], -1))
            return h, [h]

        @recompute_grad
        def call(self, x, states):
            return self.step(x, states)

    class PlainCell(Cell):
        def call(self, x, states):
            return self.step(x, states)

    if is_tf_keras(K):

        class RecomputedRNN(K.layers.RNN):
            @recompute_grad
            def call(self, inputs, mask=None, training=None, initial_state=None, constants=None):
                return super().call(
                    inputs, mask=mask, training=training, initial_state=initial_state, constants=constants
                )

    else:

        class RecomputedRNN(K.layers.RNN):
            @recompute_grad
            def call(self, sequences, initial_state=None, mask=None, training=False):
                return super().call(sequences, initial_state=initial_state, mask=mask, training=training)

    tape_blocks = {
        "call": lambda: Forces("plain"),
        "lambda": LambdaHolder,
        "method": ForcesInMethod,
        "function": ForcesInFunction,
        "sublayer": Holder,
    }
    rnns = {"RNN": K.layers.RNN, "RecomputedRNN": RecomputedRNN}
    return types.SimpleNamespace(**locals())


TAPE_BLOCKS = ("call", "lambda", "method", "function", "sublayer")


def build_model(K, kind, style):
    L = layers(K)
    K.utils.set_random_seed(0)
    if style == "sequential":
        return K.Sequential([K.Input((3,)), K.layers.Dense(3), L.Forces(kind), K.layers.Dense(1)])
    if style == "functional":
        inp = K.Input((3,))
        h = L.Forces(kind)(K.layers.Dense(3)(inp))
        return K.Model(inp, K.layers.Dense(1)(h) + ops_sum(K)(h, -1, keepdims=True))

    class Subclassed(K.Model):
        def __init__(self):
            super().__init__()
            self.pre = K.layers.Dense(3)
            self.forces = L.Forces(kind)
            self.head = K.layers.Dense(1)

        def call(self, x):
            return self.head(self.forces(self.pre(x)))

    model = Subclassed()
    model(tf.zeros([1, 3]))
    return model


def inputs():
    return tf.random.stateless_normal((6, 3), seed=(1, 2))


def grads_of(model, x, compile_mode):
    step = loss_and_gradients(model, compile_mode)
    for _ in range(2):
        loss, grads = step(x)
    return float(loss), to_numpy(grads)


@pytest.mark.parametrize("style", ["sequential", "functional", "subclassed"])
@pytest.mark.parametrize("kind", ["plain", "persistent", "watch_x_only"])
def test_inner_tape_forces_and_gradients_match(K, kind, style):
    x = inputs()
    results = {}
    for on in (False, True):
        model = build_model(K, kind, style)
        with recompute.recompute_scope(on):
            results[on] = grads_of(model, x, "function")
    (l0, g0), (l1, g1) = results[False], results[True]
    assert l0 > 0 and all(g is not None for g in g0)
    assert_all_close([l0], [l1], ["loss"])
    assert_all_close(g0, g1, ["input"] + [variable_name(K, v) for v in model.trainable_variables])
    # The weight gradients of the energy net exist only through dE/dx (second order).
    assert all(np.any(g != 0) for g in g1)


@pytest.mark.parametrize("kind", ["plain", "persistent", "watch_x_only"])
def test_inner_tape_fit_matches(K, kind):
    x = np.random.RandomState(0).randn(24, 3).astype("float32")
    y = np.random.RandomState(1).randn(24, 1).astype("float32")
    weights = []
    for on in (False, True):
        model = build_model(K, kind, "functional")
        model.compile(K.optimizers.SGD(0.05), "mse")
        with recompute.recompute_scope(on):
            hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert np.all(np.isfinite(hist.history["loss"]))
        weights.append([np.asarray(v) for v in model.variables])
    assert_all_close(weights[0], weights[1])


def tape_model(K, where):
    K.utils.set_random_seed(0)
    block = layers(K).tape_blocks[where]()
    model = K.Sequential([K.Input((3,)), K.layers.Dense(3), block, K.layers.Dense(1)])
    return model, block


@pytest.mark.parametrize("where", sorted(TAPE_BLOCKS))
def test_inner_tape_eager_raises_and_graph_is_exact(K, where):
    """Eager: the forward pass pauses every tape of the thread, so the inner tape would
    record nothing (gradients None, or silently zero): refused at the call. In a
    `tf.function` the same model is exact."""
    x = inputs()
    model, block = tape_model(K, where)
    with recompute.recompute_scope(True):
        with pytest.raises(NotImplementedError, match="opens its own `tf.GradientTape`") as err:
            grads_of(model, x, "eager")
        assert f"layer '{block.name}'" in str(err.value)
        assert "tf.function" in str(err.value) and "RECOMPUTE=0" in str(err.value)
        model(x)  # no tape recording: the call runs plainly
    results = {}
    for on in (False, True):
        with recompute.recompute_scope(on):
            results[on] = grads_of(tape_model(K, where)[0], x, "function")
    (l0, g0), (l1, g1) = results[False], results[True]
    assert_all_close([l0] + g0, [l1] + g1)
    with recompute.recompute_scope(False):  # eager without recomputation: the plain run
        l2, g2 = grads_of(tape_model(K, where)[0], x, "eager")
    assert_all_close([l0] + g0, [l2] + g2)


def test_lambda_without_tape_runs_eagerly(K):
    """A `Lambda` sublayer (tf_keras's opens a tape of its own, only to list the
    variables its function reads) is no reason to refuse an eager call."""
    x = inputs()
    results = []
    for on in (False, True):
        K.utils.set_random_seed(0)
        block = layers(K).LambdaHolder(tape=False)
        model = K.Sequential([K.Input((3,)), block, K.layers.Dense(1)])
        with recompute.recompute_scope(on):
            loss, grads = grads_of(model, x, "eager")
        results.append([np.asarray(loss)] + grads)
    assert_all_close(results[0], results[1])


def test_inner_tape_fit_run_eagerly_raises(K):
    x = np.random.RandomState(0).randn(8, 3).astype("float32")
    model, block = tape_model(K, "call")
    model.compile(K.optimizers.SGD(0.05), "mse", run_eagerly=True)
    with recompute.recompute_scope(True):
        with pytest.raises(NotImplementedError, match=f"layer '{block.name}'"):
            model.fit(x, x[:, :1], batch_size=8, verbose=0)


def test_inner_tape_under_another_name_gets_a_hint(K):
    """A tape the check cannot see records nothing in eager mode; the resulting error
    (a None gradient used) says why."""
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), layers(K).ForcesUnderAlias(), K.layers.Dense(1)])
    with recompute.recompute_scope(True):
        with pytest.raises(TypeError, match="eager forward pass of layer 'forces_under_alias'"):
            grads_of(model, inputs(), "eager")


# --------------------------------------------------------------------------- D6


def rnn_model(K, cell_cls="Cell", rnn_cls="RNN", unroll=False):
    L = layers(K)
    K.utils.set_random_seed(0)
    cell, rnn = getattr(L, cell_cls), L.rnns[rnn_cls]
    return K.Sequential([K.Input((5, 3)), rnn(cell(4), unroll=unroll), K.layers.Dense(1)])


def test_decorated_cell_in_while_loop_raises_in_graph(K):
    model = rnn_model(K)
    x = tf.random.stateless_normal((2, 5, 3), seed=(3, 4))
    with recompute.recompute_scope(True):
        with pytest.raises(NotImplementedError, match=r"while_loop.*unroll=True"):
            grads_of(model, x, "function")
        model.compile(K.optimizers.SGD(0.05), "mse")
        with pytest.raises(NotImplementedError, match="Decorate the `call` of the layer"):
            model.fit(x, tf.zeros([2, 1]), verbose=0)


@pytest.mark.parametrize(
    "cell_cls, rnn_cls, unroll, compile_mode",
    [
        ("Cell", "RNN", False, "eager"),
        ("Cell", "RNN", True, "function"),
        ("PlainCell", "RecomputedRNN", False, "function"),
        ("PlainCell", "RecomputedRNN", False, "fit"),
    ],
)
def test_rnn_alternatives_match(K, cell_cls, rnn_cls, unroll, compile_mode):
    x = tf.random.stateless_normal((4, 5, 3), seed=(3, 4))
    y = tf.random.stateless_normal((4, 1), seed=(5, 6))
    results = []
    for on in (False, True):
        model = rnn_model(K, cell_cls, rnn_cls, unroll)
        with recompute.recompute_scope(on):
            if compile_mode == "fit":
                model.compile(K.optimizers.SGD(0.05), "mse")
                model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
                results.append([np.asarray(v) for v in model.variables])
            else:
                loss, grads = grads_of(model, x, compile_mode)
                results.append([np.asarray(loss)] + grads)
    assert_all_close(results[0], results[1])


__all__ = [name for name in dir() if name.startswith("test_")]  # what the suites import
