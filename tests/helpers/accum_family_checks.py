"""AccumOptimizer checks that are the same in every Keras family, written once.

Each family runs in a pytest process of its own (README), so each suite has a
module that imports the checks that apply to it, with the fixture `family` of
that suite:

- tests/accum_keras3/test_family_checks.py (Keras 3, TensorFlow backend),
- tests/accum_jax/test_family_checks_jax.py (Keras 3, JAX backend),
- tests/accum_tf_keras/test_family_checks_tf_keras.py (tf_keras; "legacy"
  optimizers too where they apply).

`from tests.helpers.accum_family_checks import *` brings the checks of every backend
(`__all__`); the TensorFlow-only ones (`TENSORFLOW_ONLY`) and the fixture `family`
of the suite (`keras3_family` or `tf_keras_family`) are imported by name. The other
accum checks written once (`accum_*_checks`) take the same fixture, with `legacy`
(`new_style_only` or, tf_keras, `new_style_and_legacy`) and `floatx`.

Numbers are compared in float32 (floatx is float32 in every suite) against a
reference run: the same optimizer fed zeros, or `mode="buffer"`.
"""

import contextlib
import dataclasses
import re
import types
import warnings

import numpy as np
import pytest

__all__ = [
    "test_compiling_again_with_pending_micro_steps_warns",
    "test_rescale_at_the_largest_k_moves_the_weights_like_buffer",
    "test_rescale_checks_the_variables_dtype_when_built",
    "test_rescale_non_finite_micro_step_counts_as_zero_wherever_it_is",
    "test_rescale_refuses_a_k_its_coefficients_cannot_hold_in_float32",
    "test_rescale_refuses_a_loss_scale_optimizer_inside_and_points_outside",
    "test_rescale_warns_about_the_last_micro_gradient_only_when_k_is_above_1",
]
TENSORFLOW_ONLY = ["test_momentum_flush_is_refused_and_the_window_is_carried_exactly"]  # mode="momentum"


@dataclasses.dataclass(frozen=True)
class Family:
    """What a check needs of one Keras family."""

    K: types.ModuleType  # `keras` or `tf_keras`
    variable: object  # (values, dtype) -> a trainable variable of this family
    holds_float64: bool  # whether a float64 variable holds float64 (not so on JAX without x64)
    legacy: bool  # whether the family has legacy optimizers (tf_keras)

    def optimizers(self, legacy=False):
        return self.K.optimizers.legacy if legacy else self.K.optimizers

    def kinds(self):
        """The optimizer namespaces to try: new-style, and legacy where there is one."""
        return [False, True] if self.legacy else [False]

    @property
    def reference(self):
        """The module of reference runs at batch k*b: tests.helpers.k3_reference or tfk_reference."""
        from tests.helpers import k3_reference, tfk_reference

        return tfk_reference if self.legacy else k3_reference

    @contextlib.contextmanager
    def floatx(self, dtype):
        previous = self.K.backend.floatx()
        self.K.backend.set_floatx(dtype)
        try:
            yield
        finally:
            self.K.backend.set_floatx(previous)


@pytest.fixture(name="family")
def keras3_family():
    """Keras 3, on the backend of this process (TensorFlow or JAX)."""
    import keras

    holds_float64 = True
    if keras.backend.backend() == "jax":
        import jax

        holds_float64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    return Family(
        K=keras,
        variable=lambda values, dtype="float32": keras.Variable(np.asarray(values, dtype), dtype=dtype),
        holds_float64=holds_float64,
        legacy=False,
    )


@pytest.fixture(name="family")
def tf_keras_family():
    import tensorflow as tf
    import tf_keras

    return Family(
        K=tf_keras,
        variable=lambda values, dtype="float32": tf.Variable(np.asarray(values, dtype)),
        holds_float64=True,
        legacy=True,
    )


@pytest.fixture(name="legacy")
def new_style_only():
    """Keras 3: the optimizers of `keras.optimizers` only."""
    return False


@pytest.fixture(name="legacy", params=[False, True], ids=["new", "legacy"])
def new_style_and_legacy(request):
    """tf_keras: a check runs with `tf_keras.optimizers` and with `tf_keras.optimizers.legacy`."""
    return request.param


@pytest.fixture
def floatx(family):
    """Sets the family's floatx for one test: `floatx("float64")` returns "float64"."""
    with contextlib.ExitStack() as stack:

        def set_to(dtype):
            stack.enter_context(family.floatx(dtype))
            return dtype

        yield set_to


@contextlib.contextmanager
def no_accum_warning():
    """Fails if the block issues a warning of accum's (JAX's int64 truncation ones are not)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [str(w.message) for w in caught if "AccumOptimizer" in str(w.message)]
    assert not ours, ours


def _values(variable):
    return np.array(variable.numpy())


# ------------------------------------------------------------------ rescale: precision

# (optimizer, arguments, k beyond the bound, the coefficient named, the largest k in float32:
#  floor(0.01 * (1 - β) * 2**25))
TOO_LARGE = [
    ("Adam", dict(learning_rate=0.01, beta_2=0.9999), 4096, "beta_2", 33),  # β̃₂ rounds to 1.0
    ("Adam", dict(learning_rate=0.01), 40000, "beta_2", 335),  # the default β₂ rounds to 1.0
    ("SGD", dict(learning_rate=0.1, momentum=0.9), 40000, "momentum", 33554),
    ("RMSprop", dict(rho=0.9, momentum=0.5), 40000, "rho", 33554),  # rho before momentum (167772)
    ("Lion", dict(learning_rate=1e-3), 4000, "beta_2", 3355),
]


@pytest.mark.parametrize("name,kwargs,k,coefficient,largest", TOO_LARGE,
                         ids=[f"{c[0]}-{c[3]}-{c[2]}" for c in TOO_LARGE])
def test_rescale_refuses_a_k_its_coefficients_cannot_hold_in_float32(family, name, kwargs, k, coefficient, largest):
    """β̃ = 1 − (1 − β)/k is computed in float32 by the inner optimizer: refused at
    construction, naming the coefficient and the largest k that keeps 1 − β̃ within 1%."""
    from accum import AccumOptimizer

    make = getattr(family.optimizers(), name)
    with pytest.raises(ValueError) as info:
        AccumOptimizer(make(**kwargs), k, mode="rescale")
    message = str(info.value)
    for part in (f"rewrites `{coefficient}`", "in float32",
                 f"for every steps_per_update <= {largest} with {coefficient}=",
                 '`mode="buffer"`', f"Received: steps_per_update={k}, {coefficient}="):
        assert part in message, (part, message)
    AccumOptimizer(make(**kwargs), largest, mode="rescale")  # the bound itself is accepted


def test_rescale_at_the_largest_k_moves_the_weights_like_buffer(family):
    """At the bound (k=33 for beta_2=0.9999), one window of a constant gradient moves Adam's
    weights by the learning rate, as `mode="buffer"` (= the same Adam fed the mean) does."""
    from accum import AccumOptimizer

    k, gradient = 33, np.array([1.0, -2.0, 3.0], "float32")
    moved = {}
    for mode in ("buffer", "rescale"):
        variable = family.variable(np.zeros(3))
        opt = AccumOptimizer(family.optimizers().Adam(0.01, beta_2=0.9999), k, mode=mode)
        for _ in range(k):
            opt.apply_gradients([(gradient, variable)])
        assert int(opt.iterations.numpy()) == 1
        moved[mode] = _values(variable)
    np.testing.assert_allclose(moved["buffer"], -0.01 * np.sign(gradient), rtol=1e-4)
    np.testing.assert_allclose(moved["rescale"], moved["buffer"], rtol=1e-2)


def test_rescale_checks_the_variables_dtype_when_built(family):
    """Under floatx float64 a large k is accepted at construction (where float64 holds float64)
    and refused when built for float32 variables; float64 variables are fine."""
    from accum import AccumOptimizer

    def make():
        return AccumOptimizer(family.optimizers().Adam(0.01, beta_2=0.9999), 4096, mode="rescale")

    with family.floatx("float64"):
        if not family.holds_float64:  # JAX without x64: float64 variables hold float32
            with pytest.raises(ValueError, match="in float32"):
                make()
            return
        opt, opt64 = make(), make()
    with pytest.raises(ValueError, match=r"in float32 \(the dtype of the variable .*steps_per_update <= 33 "):
        opt.build([family.variable(np.zeros(3), "float32")])
    opt64.build([family.variable(np.zeros(3), "float64")])


# ---------------------------------------------------------------- rescale: rough edges

@pytest.mark.parametrize("position", [1, 3], ids=["middle", "last"])
def test_rescale_non_finite_micro_step_counts_as_zero_wherever_it_is(family, position):
    """A non-finite micro-gradient (NaN) is a zero gradient, in the middle of the window as
    at its last micro-step: weights, slots and the update count equal a run fed zeros there
    (the window ends with its update either way)."""
    from accum import AccumOptimizer

    k = 4
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=3).astype("float32") for _ in range(2 * k)]
    runs = []
    for bad in (np.nan, 0.0):
        variable = family.variable(np.ones(3))
        opt = AccumOptimizer(family.optimizers().Adam(0.1), k, mode="rescale")
        for j, g in enumerate(grads):
            opt.apply_gradients([(np.full(3, bad, "float32") if j == position else g, variable)])
        assert int(opt.iterations.numpy()) == 2, (bad, int(opt.iterations.numpy()))
        inner = opt.inner_optimizer
        slots = inner.variables() if callable(inner.variables) else inner.variables
        runs.append([_values(variable)] + [_values(v) for v in slots])
    nan_run, zero_run = runs
    assert all(np.isfinite(a).all() for a in nan_run)
    for a, b in zip(nan_run, zero_run):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(nan_run[0], 1.0)


def test_rescale_refuses_a_loss_scale_optimizer_inside_and_points_outside(family):
    from accum import AccumOptimizer

    K = family.K
    with pytest.raises(ValueError) as info:
        AccumOptimizer(K.mixed_precision.LossScaleOptimizer(K.optimizers.Adam()), 4, mode="rescale")
    message = str(info.value)
    assert "keeps no moving average" not in message, message
    assert ("wrap the AccumOptimizer in the LossScaleOptimizer, "
            '`LossScaleOptimizer(AccumOptimizer(Adam(...), 4, mode="rescale"))`') in message, message
    assert re.search(r"Received: optimizer=LossScaleOptimizer\w* wrapping Adam$", message), message
    # The place it points to works: the LossScaleOptimizer outside, in `fit`.
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    before = [np.array(w) for w in model.get_weights()]
    accum = AccumOptimizer(K.optimizers.Adam(0.1), 2, mode="rescale")
    model.compile(K.mixed_precision.LossScaleOptimizer(accum), "mse")
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 1), "float32"), batch_size=1, verbose=0)
    assert int(accum.iterations.numpy()) == 2 and int(accum.micro_steps.numpy()) == 4
    assert not np.allclose(before[0], model.get_weights()[0])


@pytest.mark.parametrize("name", ["RMSprop", "Adadelta", "Adafactor"])
def test_rescale_warns_about_the_last_micro_gradient_only_when_k_is_above_1(family, name):
    """At k=1 nothing is rescaled and every micro-step moves the weights: no warning."""
    from accum import AccumOptimizer

    make = getattr(family.optimizers(), name)
    with no_accum_warning():
        AccumOptimizer(make(), 1, mode="rescale")
    with pytest.warns(UserWarning, match=r"only the window's last micro-gradient \(1 of 2\)"):
        AccumOptimizer(make(), 2, mode="rescale")


# ------------------------------------------------------------------ momentum: flush

def test_momentum_flush_is_refused_and_the_window_is_carried_exactly(family):
    """`flush()` cannot normalize a partial window by its count in `mode="momentum"` (the
    micro-gradients are already in the moments, scaled by 1/k): refused, with `flush_callback`.
    The pending micro-steps stay and join the next window, as `mode="buffer"` carries them."""
    from accum import AccumOptimizer

    k = 4
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=3).astype("float32") for _ in range(2 * k)]
    for legacy in family.kinds():
        runs = {}
        for mode in ("buffer", "momentum"):
            variable = family.variable(np.ones(3))
            opt = AccumOptimizer(family.optimizers(legacy).SGD(0.1, momentum=0.9), k, mode=mode)
            for j, g in enumerate(grads):
                opt.apply_gradients([(g, variable)])
                if mode == "momentum" and j == k + 1:  # 2 micro-steps pending
                    before = _values(variable)
                    with pytest.raises(ValueError, match=r'`flush\(\)` needs `mode="buffer"`: with '
                                       r'`mode="momentum"`.*normalized by its count.*Received: mode="momentum"'):
                        opt.flush()
                    with pytest.raises(ValueError, match='needs `mode="buffer"`'):
                        opt.flush_callback()
                    np.testing.assert_array_equal(_values(variable), before)
                    assert int(opt.window_steps.numpy()) == 2
            assert int(opt.iterations.numpy()) == 2, (legacy, mode)
            runs[mode] = _values(variable)
        np.testing.assert_allclose(runs["momentum"], runs["buffer"], rtol=1e-6, err_msg=f"legacy={legacy}")
    # The end-of-`fit` warning does not offer `flush()` (tf_keras's `fit` warns for new-style only).
    _, messages = _fit_leaving_pending(
        family, AccumOptimizer(family.optimizers().SGD(0.1, momentum=0.9), 4, mode="momentum"))
    pending = [m for m in messages if "pending at the end of training" in m]
    assert len(pending) == 1 and "`flush()` needs mode=\"buffer\"" in pending[0], messages


# --------------------------------------------------------------------- recompiling

def _fit_leaving_pending(family, optimizer):
    """A model trained by `fit` on 6 micro-batches with `optimizer` (k=4): 2 pending.
    Returns it and the messages of the warnings `fit` issued."""
    K = family.K
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 1)).astype("float32"),
                  batch_size=1, shuffle=False, verbose=0)
    return model, [str(w.message) for w in caught]


def test_compiling_again_with_pending_micro_steps_warns(family):
    """Compiling with another optimizer drops the pending micro-steps: a warning says how
    many and how to keep them. Compiling again with the same optimizer, or after `flush()`,
    drops nothing and does not warn."""
    from accum import AccumOptimizer

    for legacy in family.kinds():
        sgd = family.optimizers(legacy).SGD
        model, _ = _fit_leaving_pending(family, AccumOptimizer(sgd(0.1), 4))
        with pytest.warns(UserWarning, match=r"compiling the model with another optimizer drops the 2 "
                          r"micro-step\(s\) pending .*steps_per_update=4.*call the AccumOptimizer's "
                          r"`flush\(\)` before `compile`"):
            model.compile(sgd(0.1), "mse")

        opt = AccumOptimizer(sgd(0.1), 4)
        model, _ = _fit_leaving_pending(family, opt)
        with no_accum_warning():
            model.compile(opt, "mse")  # the same optimizer: its window is kept
            opt.flush()
            model.compile(sgd(0.1), "mse")  # nothing pending any more
    model, _ = _fit_leaving_pending(
        family, AccumOptimizer(family.optimizers().Adam(0.01), 4, mode="rescale"))
    with pytest.warns(UserWarning, match=r"drops the 2 micro-step\(s\).*mode=\"rescale\".*window's end, "
                      r"after a multiple of 4 micro-steps"):
        model.compile("adam", "mse")
