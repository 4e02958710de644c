"""`recompute_grad(offload=True)` on Keras 3's JAX backend: the loss, every gradient and every
state update equal RECOMPUTE=0's (seeded and unseeded dropout, BatchNorm, add_loss), jit and
not; the residuals are host copies; on a CPU (this suite's device) host memory is the device's,
so nothing moves, exactly. The options it does not take are refused clearly."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from recompute import recompute_grad, recompute_scope
from tests.helpers.numerics import assert_all_close
from tests.recompute_jax.test_recompute_jax import (FEATURES, Block, assert_recompute_matches, build,
                                                     stateless_step)


class OffloadedBlock(Block):
    """`Block` with its call's inputs kept in host memory."""

    @recompute_grad(offload=True)
    def call(self, x, training=None):
        return Block.call.__recompute_grad_wrapped__(self, x, training=training)


def build_offloaded(seed=0, blocks=2):
    return build(seed, blocks, block=OffloadedBlock)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
def test_offloaded_gradients_match_no_recompute(jit):
    model = build_offloaded()
    loss0, (loss1, grads1, _) = assert_recompute_matches(model, jit)
    # and the same as the plain checkpoint's
    plain = build()
    plain.set_weights(model.get_weights())
    loss2, grads2, _ = stateless_step(plain, True, jit)
    assert abs(loss2 - loss1) <= 1e-6 * abs(loss0)
    assert_all_close(grads2, grads1, [v.path for v in model.trainable_variables])


def test_residuals_are_host_copies_of_the_inputs():
    model = build_offloaded()
    x = np.ones((4, FEATURES), "float32")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable):
        with recompute_scope(True):
            out, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(out)

    text = str(jax.make_jaxpr(jax.grad(loss_fn))(trainable))
    # each block's input goes to the host and back (the custom_vjp is differentiated away)
    assert text.count("f32<host>[4,16] = device_put") == 2, text
    assert "optimization_barrier" in text and "remat" not in text


def test_fit_matches_with_offload():
    x = np.random.default_rng(0).normal(size=(32, FEATURES)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
    results = []
    for on in (False, True):
        model = build_offloaded()
        model.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=True)
        with recompute_scope(on):
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        results.append((model.get_weights(), history.history["loss"]))
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
    assert_all_close(results[0][0], results[1][0])


def test_offload_options_refused():
    with pytest.raises(ValueError, match='policy="full" only'):
        recompute_grad(policy="attention", offload=True)
    with pytest.raises(TypeError, match="True or False"):
        recompute_grad(offload="yes")


def _docs_example():
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "recompute.md").read_text(encoding="utf-8")
    section = text[text.index("## Host offload"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
def test_docs_example_runs_and_matches_no_recompute(jit):
    code = _docs_example()
    assert "@recompute_grad(offload=True)" in code
    namespace = {}
    exec(code, namespace)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = inputs
    for _ in range(3):
        h = namespace["Block"](FEATURES)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    assert_recompute_matches(model, jit, state=False)


def test_bert4keras_patch_refuses_offload():
    import recompute.bert4keras

    with pytest.raises(ValueError, match="tf_keras"):
        recompute.bert4keras.patch(offload=True)


def test_keras_hub_patch_takes_offload():
    pytest.importorskip("keras_hub")
    import recompute.keras_hub as hub
    from tests.helpers.keras_hub_checks import batch, check_recompute_exact, classifier, tiny_backbone

    with pytest.raises(ValueError, match='policy="full" only'):
        hub.patch(policy="attention", offload=True)
    x, y = batch()
    try:
        hub.patch(offload=True)
        assert hub.is_patched() == "full"
        # a tiny BertBackbone (dropout 0.1, padding), `train_on_batch`: RECOMPUTE=0's gradients
        check_recompute_exact(classifier(tiny_backbone(0)), x, y)
        hub.patch()  # a switch of offload alone re-patches
        assert hub.is_patched() == "full"
    finally:
        hub.unpatch()
    assert hub.is_patched() is None
