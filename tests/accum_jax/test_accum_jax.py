"""AccumOptimizer on Keras 3's JAX backend: through Keras's JAX trainer (`stateless_apply`),
batch b with k micro-steps trains exactly like the inner optimizer at batch k*b -- weights
and every slot -- for the optimizers of the TensorFlow suite; schedules count updates;
partial windows and flush; a non-finite micro-batch is skipped; the inner update is
traced inside a `jax.lax.cond` (computed only on update steps); save mid-window, resume
in a fresh process bit for bit."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from accum import AccumOptimizer
from tests.helpers import save_resume_checks as checks
from tests.helpers.k3_optimizers import OPTIMIZERS
from tests.helpers.numerics import assert_grouped_close

K, B, UPDATES = 4, 3, 5
# float32: XLA fuses the loss's mean over b (k times) and over k*b differently, a rounding
# difference of up to ~3e-6 after 5 updates on one CPU, 9.3e-6 (AdamW with a schedule,
# jax 0.10.2 on an AVX-512 CPU, 2026-11-26) on another: the suites' float32 tolerance,
# 1e-5. Float64 (JAX_ENABLE_X64, below): 1e-12.
TOL = 1e-5
VOCAB, TOKENS, FEATURES = 40, 3, 6


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    dtype = keras.config.floatx()
    x = rng.normal(size=(n, FEATURES)).astype(dtype)
    ids = rng.integers(0, VOCAB, size=(n, TOKENS)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return [x, ids], y


def make_model(seed=0):
    """An embedding (a gather's gradient) and dense layers."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    ids = keras.Input((TOKENS,), dtype="int32")
    e = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(ids))
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([x, e]))
    return keras.Model([x, ids], keras.layers.Dense(1)(h))


def fresh(optimizer):
    return optimizer.__class__.from_config(optimizer.get_config())


def slot_kind(name):
    return name.rsplit("_", 1)[-1] if ":" in name else "weights"


def slots(optimizer):
    return {f"{i}:{v.name}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)}


def compare(make_inner, jit_compile, k=K, n=K * B * UPDATES, callbacks=()):
    """Trains `AccumOptimizer(inner, k)` at batch B and the inner optimizer at batch k*B with
    `fit` on the same data; returns both (weights and slots compared)."""
    x, y = make_data(n)
    model, reference = make_model(), make_model()
    inner = make_inner()
    ref_opt, opt = fresh(inner), AccumOptimizer(inner, k)
    model.compile(opt, "mse", jit_compile=jit_compile)
    reference.compile(ref_opt, "mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0,
              callbacks=[cb(opt) for cb in callbacks])
    reference.fit(x, y, batch_size=k * B, shuffle=False, verbose=0)
    ref_slots, got_slots = slots(ref_opt), slots(opt.inner_optimizer)
    assert [slot_kind(n) for n in ref_slots] == [slot_kind(n) for n in got_slots]
    names = [w.path for w in model.weights] + list(got_slots)
    assert_grouped_close(
        reference.get_weights() + list(ref_slots.values()),
        model.get_weights() + list(got_slots.values()),
        TOL, names, slot_kind, floor_fraction=1.0,
    )
    assert not np.allclose(make_model().get_weights()[2], model.get_weights()[2])
    return opt, ref_opt


# Centered RMSprop amplifies float32 rounding (see tests/accum_keras3/test_exactness.py);
# JAX runs float32 here (x64 is off).
@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"rmsprop_momentum_centered"}))
def test_fit_matches_big_batch_jit(name):
    opt, ref_opt = compare(OPTIMIZERS[name], True)
    assert type(opt).__name__ == "JaxAccumOptimizer"
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == UPDATES
    assert int(opt.micro_steps.numpy()) == K * UPDATES


# Eagerly, op by op (20 to 70 s each here): the richest update (a schedule, clipping, Adam's
# slots) and the plainest; `test_fit_matches_big_batch_jit` runs every optimizer.
@pytest.mark.parametrize("name", ["adam_schedule_clipnorm", "sgd_momentum"])
def test_fit_matches_big_batch_without_jit(name):
    compare(OPTIMIZERS[name], False)


def test_float64_matches_to_1e_12():
    """The same comparison in float64 (a fresh process with JAX_ENABLE_X64=1): what is left
    in float32 is rounding."""
    import os
    import subprocess
    import sys

    names = ["adamw_schedule", "rmsprop_momentum", "rmsprop_momentum_centered", "adam_ema",
             "adam_clipvalue_amsgrad"]
    code = (
        "import keras; keras.config.set_floatx('float64')\n"
        "import tests.accum_jax.test_accum_jax as t\n"
        "from tests.helpers.k3_optimizers import OPTIMIZERS\n"
        "t.TOL = 1e-12\n"
        f"for name in {names!r}:\n"
        "    t.compare(OPTIMIZERS[name], True)\n"
        "print('float64 ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_ENABLE_X64="1", KERAS_BACKEND="jax")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "float64 ok" in proc.stdout, proc.stderr[-4000:]


def test_partial_window_flushed_at_epoch_end():
    """2 full windows and 2 pending micro-steps per epoch; the flush applies their mean,
    like the inner optimizer's last, smaller batch (2B) of each epoch."""
    opt, ref_opt = compare(OPTIMIZERS["adam_schedule_clipnorm"], True, n=(2 * K + 2) * B,
                           callbacks=[lambda o: o.flush_callback()])
    assert int(opt.iterations.numpy()) == 3 and int(opt.window_steps.numpy()) == 0


def test_pending_window_warns_at_end_of_fit():
    x, y = make_data(6 * B)
    model = make_model()
    model.compile(AccumOptimizer(keras.optimizers.Adam(0.01), K), "mse")
    with pytest.warns(UserWarning, match="2 micro-step\\(s\\) of an incomplete window"):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(model.optimizer.window_steps.numpy()) == 2
    model.optimizer.flush()
    assert int(model.optimizer.iterations.numpy()) == 2 and int(model.optimizer.window_steps.numpy()) == 0


def stateless_steps(opt, model, batches):
    """Keras's JAX trainer's update path by hand: grads, then `opt.stateless_apply` under jit."""
    trainable = [v.value for v in model.trainable_variables]
    opt_vars = [v.value for v in opt.variables]

    def loss_fn(trainable, x, ids, y):
        out, _ = model.stateless_call(trainable, [], [x, ids])
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(trainable, opt_vars, x, ids, y, poison):
        grads = jax.grad(loss_fn)(trainable, x, ids, y)
        grads = [g * poison for g in grads]
        return opt.stateless_apply(opt_vars, grads, trainable)

    for (x, ids), y, poison in batches:
        trainable, opt_vars = step(trainable, opt_vars, x, ids, y, poison)
    for v, value in zip(model.trainable_variables, trainable):
        v.assign(value)
    for v, value in zip(opt.variables, opt_vars):
        v.assign(value)


def test_non_finite_micro_batch_is_skipped():
    """A micro-batch with an infinite gradient is left out of the window's mean: the update
    is the inner optimizer's on the other k-1 micro-batches."""
    (x, ids), y = make_data(K * B)
    model, reference = make_model(), make_model()
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), K)
    ref_opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    ref_opt.build(reference.trainable_variables)
    micro = [((x[i * B:(i + 1) * B], ids[i * B:(i + 1) * B]), y[i * B:(i + 1) * B],
              jnp.float32(np.inf if i == 1 else 1.0)) for i in range(K)]
    stateless_steps(opt, model, micro)
    keep = np.r_[0:B, 2 * B:K * B]
    stateless_steps(ref_opt, reference, [((x[keep], ids[keep]), y[keep], jnp.float32(1.0))])
    assert int(opt.iterations.numpy()) == 1 and int(opt.micro_steps.numpy()) == K
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_inner_update_is_inside_a_cond():
    """The inner optimizer's update is traced in a `jax.lax.cond`: only update steps run it."""
    model = make_model()
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), K)
    opt.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    grads = [jnp.ones_like(t) for t in trainable]
    jaxpr = jax.make_jaxpr(opt.stateless_apply)([v.value for v in opt.variables], grads, trainable)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1
    # The branch that updates holds Adam's square root; the other holds no arithmetic.
    branches = conds[0].params["branches"]
    names = [{e.primitive.name for e in b.jaxpr.eqns} for b in branches]
    assert any("sqrt" in n for n in names) and any("sqrt" not in n for n in names)


def test_momentum_mode_is_refused_on_jax():
    with pytest.raises(NotImplementedError, match="TensorFlow backend only.*'jax' backend"):
        AccumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), K, mode="momentum")


def test_config_round_trip():
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), K)
    again = AccumOptimizer.from_config(opt.get_config())
    assert type(again).__name__ == "JaxAccumOptimizer" and again.steps_per_update == K
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored).__name__ == "JaxAccumOptimizer"


KINDS = ("sequential", "functional", "subclassed")
PLAN = {("adam", kind): ["keras", "weights"] for kind in KINDS}
PLAN[("rescale", "functional")] = ["keras"]
CASES = checks.cases(PLAN)
saved_and_resumed = checks.saved_and_resumed_fixture("keras", PLAN, "save_resume_jax")


@pytest.mark.parametrize("case", CASES, ids=checks.ids(CASES))
def test_resume_mid_window_in_fresh_process_is_bit_exact(saved_and_resumed, case):
    checks.check_resumed_mid_window(saved_and_resumed, case)


def test_variable_without_gradient_in_the_window_keeps_weights_and_slots():
    """A head that gets no gradient (None) in a whole window is not updated and its Adam
    slots do not decay, as with the inner optimizer at batch k*b; the other head is exact."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(hidden)])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    (x, _), y = make_data(2 * K * B)

    def run(opt, net, batch, windows):
        opt.build(net.trainable_variables)
        trainable = [v.value for v in net.trainable_variables]
        opt_vars = [v.value for v in opt.variables]

        def loss_fn(trainable, xb, yb, first_head):
            (a, b), _ = net.stateless_call(trainable, [], xb)
            return jnp.mean(((a if first_head else b) - yb) ** 2)

        for w in range(windows):
            first_head = w == 0
            for s in range(0, len(x) // windows, batch):
                lo = w * (len(x) // windows) + s
                grads = jax.grad(loss_fn)(trainable, x[lo:lo + batch], y[lo:lo + batch], first_head)
                # the head the loss does not use gets None, as a tape gives it
                unused = net.layers[-1] if first_head else net.layers[-2]
                unused_ids = {id(v) for v in unused.trainable_variables}
                grads = [None if id(v) in unused_ids else g for g, v in zip(grads, net.trainable_variables)]
                trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        for v, value in zip(net.trainable_variables, trainable):
            v.assign(value)
        for v, value in zip(opt.variables, opt_vars):
            v.assign(value)

    start = model.get_weights()
    opt, ref_opt = AccumOptimizer(keras.optimizers.Adam(0.01), K), keras.optimizers.Adam(0.01)
    run(opt, model, B, 2)           # window 1: head A only; window 2: head B only
    run(ref_opt, reference, K * B, 2)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    for a, b in zip(ref_opt.variables, opt.inner_optimizer.variables):
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=2e-5, atol=1e-9)
    assert not np.allclose(start[-1], model.get_weights()[-1])


def scaled_steps(opt, model, batches):
    """Micro-steps with the loss scaled by `opt.scale_loss` (a LossScaleOptimizer's scale),
    applied by `opt.stateless_apply` under jit, as Keras's JAX trainer does."""
    trainable = [v.value for v in model.trainable_variables]
    opt_vars = [v.value for v in opt.variables]

    def loss_fn(trainable, opt_vars, x, ids, y):
        out, _ = model.stateless_call(trainable, [], [x, ids])
        loss = jnp.mean((out - y) ** 2)
        with keras.StatelessScope(list(zip(opt.variables, opt_vars))):
            return opt.scale_loss(loss)

    @jax.jit
    def step(trainable, opt_vars, x, ids, y):
        grads = jax.grad(loss_fn)(trainable, opt_vars, x, ids, y)
        return opt.stateless_apply(opt_vars, grads, trainable)

    for (x, ids), y in batches:
        trainable, opt_vars = step(trainable, opt_vars, x, ids, y)
    for v, value in zip(model.trainable_variables, trainable):
        v.assign(value)
    for v, value in zip(opt.variables, opt_vars):
        v.assign(value)


def poisoned(n_micro, bad):
    (x, ids), y = make_data(B * n_micro)
    y = y.copy()
    y[bad * B] = 3e38  # the squared error overflows float32: non-finite gradients
    return [((x[i * B:(i + 1) * B], ids[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) for i in range(n_micro)]


def joined(micro, indices):
    (xs, ids), ys = zip(*[m[0] for m in (micro[i] for i in indices)]), [micro[i][1] for i in indices]
    return (np.concatenate(xs), np.concatenate(ids)), np.concatenate(ys)


def check_windows(model, inner, micro, windows):
    reference = make_model()
    ref_opt = keras.optimizers.Adam(0.01)
    ref_opt.build(reference.trainable_variables)
    stateless_steps(ref_opt, reference, [(x, y, jnp.float32(1.0)) for x, y in
                                         (joined(micro, w) for w in windows)])
    assert int(inner.iterations.numpy()) == len(windows)
    for a, b in zip(reference.get_weights() + [np.asarray(v.numpy()) for v in ref_opt.variables],
                    model.get_weights() + [np.asarray(v.numpy()) for v in inner.variables]):
        np.testing.assert_allclose(a, b, rtol=5e-6, atol=1e-8)


def test_loss_scale_optimizer_outside():
    """LSO(AccumOptimizer): the LSO drops the bad micro-step; windows are k finite micro-steps."""
    micro = poisoned(9, bad=2)
    model = make_model()
    inner = keras.optimizers.Adam(0.01)
    opt = keras.optimizers.LossScaleOptimizer(AccumOptimizer(inner, K), initial_scale=2.0**10)
    opt.build(model.trainable_variables)
    scaled_steps(opt, model, micro)
    assert float(opt.dynamic_scale.numpy()) == 2.0**9
    check_windows(model, inner, micro, [[0, 1, 3, 4], [5, 6, 7, 8]])


def test_loss_scale_optimizer_inside():
    """AccumOptimizer(LSO): the bad micro-batch is skipped, the mean divides by the 3 kept,
    and the inner scale is halved as the LSO would."""
    micro = poisoned(8, bad=2)
    model = make_model()
    adam = keras.optimizers.Adam(0.01)
    lso = keras.optimizers.LossScaleOptimizer(adam, initial_scale=2.0**10)
    opt = AccumOptimizer(lso, K)
    opt.build(model.trainable_variables)
    scaled_steps(opt, model, micro)
    assert float(lso.dynamic_scale.numpy()) == 2.0**9 and int(opt.micro_steps.numpy()) == 8
    check_windows(model, adam, micro, [[0, 1, 3], [4, 5, 6, 7]])
