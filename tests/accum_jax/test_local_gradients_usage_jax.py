"""`accum.local_gradients` as documented (one CPU device: a batch axis of one shard): the
examples of docs/distribution.md and of its docstring run as written; `mixed_float16`
(Keras's `LossScaleOptimizer` around the `AccumOptimizer`) trains; compiling again with
another optimizer, or `local_gradients(model, enabled=False)`, gives back Keras's step;
compiling again with another buffered `AccumOptimizer` keeps the step without a second call."""

import os
import re
import textwrap

import keras
import pytest

import accum
from accum import AccumOptimizer
from tests.helpers.local_gradients_models import data, data_parallel, mlp
from tests.helpers.numerics import assert_all_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B = 4
REPLACED = {"train_step", "make_train_function", "fit", "train_on_batch"}


def accum_adam(k=3):
    return AccumOptimizer(keras.optimizers.Adam(1e-2), k)


# ------------------------------------------------------------ the documented examples

def documented_examples():
    """(where, code) of every Python example that calls `local_gradients`: in
    docs/distribution.md and in `local_gradients`' docstring."""
    with open(os.path.join(ROOT, "docs", "distribution.md")) as f:
        blocks = [("docs/distribution.md", b) for b in re.findall(r"```python\n(.*?)```", f.read(), re.S)]
    blocks += [("local_gradients.__doc__", textwrap.dedent(b))
               for b in re.findall(r"```python\n(.*?)```", textwrap.dedent(accum.local_gradients.__doc__), re.S)]
    return [(where, code) for where, code in blocks if "local_gradients(" in code]


EXAMPLES = documented_examples()


def test_every_documented_example_is_run():
    """The docs' two examples (one host, several hosts) and the docstring's."""
    assert [where for where, _ in EXAMPLES] == ["docs/distribution.md"] * 2 + ["local_gradients.__doc__"]


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[f"{w}-{i}" for i, (w, _) in enumerate(EXAMPLES)])
def test_documented_example_runs_as_written(where, code, monkeypatch):
    """Each example, with its placeholders defined (one process: `initialize` does nothing),
    trains through the local step."""
    monkeypatch.setattr(keras.distribution, "initialize", lambda *args, **kwargs: None)
    x, y = data(6 * B)
    models = []

    def build_model():
        models.append(mlp())
        return models[-1]

    namespace = dict(keras=keras, accum=accum, AccumOptimizer=AccumOptimizer, build_model=build_model,
                     loss="mse", x=x, y=y, my_shard_x=x, my_shard_y=y, global_micro_batch=B,
                     N=1, RANK=0)
    exec(compile(code, f"<{where}>", "exec"), namespace)
    (model,) = models
    assert REPLACED <= set(vars(model)), where
    assert int(model.optimizer.micro_steps.numpy()) > 0, where
    assert [tuple(b.shape) for b in model.optimizer.accumulators] == [
        (1, *w.shape) for w in model.trainable_variables], where  # the buffers' rows: the local step ran


def test_outside_the_scope_says_where_to_call_it():
    with data_parallel().scope():
        model = mlp()
        model.compile(accum_adam(), "mse")
    with pytest.raises(ValueError, match=r"call `local_gradients` and `fit` inside the `with "
                       r"distribution.scope\(\):`.*Received: distribution=None"):
        accum.local_gradients(model)


# --------------------------------------------------------------------- mixed_float16

def test_mixed_float16_trains_as_keras_step():
    """`compile` wraps the AccumOptimizer in a LossScaleOptimizer; the local step scales the
    loss, skips and counts as Keras's step does (one shard: to the same weights)."""
    x, y = data(6 * B)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        models = []
        for local in (False, True):
            with data_parallel().scope():
                model = mlp()
                model.compile(accum_adam(), "mse")
                assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
                if local:
                    accum.local_gradients(model)
                model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
            models.append(model)
    finally:
        keras.config.set_dtype_policy("float32")
    reference, model = models
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)
    for optimizer in (reference.optimizer, model.optimizer):
        assert int(optimizer.iterations.numpy()) == 2 and float(optimizer.dynamic_scale.numpy()) == 32768.0
    assert tuple(model.optimizer.inner_optimizer.accumulators[0].shape) == (1, 3, 5)


def test_loss_scale_optimizer_around_another_optimizer_is_named():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with data_parallel().scope():
            model = mlp()
            model.compile(keras.optimizers.Adam(), "mse")
            with pytest.raises(ValueError, match="`LossScaleOptimizer` that `compile` wraps it in.*"
                               "Received: optimizer=<.*LossScaleOptimizer.*, wrapping <.*Adam"):
                accum.local_gradients(model)
    finally:
        keras.config.set_dtype_policy("float32")


# ---------------------------------------------------------------- and back again

def trained_twice(local, second_optimizer, undo=False):
    """3 micro-steps with `accum_adam()` (local or not), then, compiled with
    `second_optimizer()` (or not, with `undo`), 3 more."""
    x, y = data(6 * B)
    with data_parallel().scope():
        model = mlp()
        model.compile(accum_adam(), "mse")
        if local:
            accum.local_gradients(model)
        model.fit(x[:3 * B], y[:3 * B], batch_size=B, shuffle=False, verbose=0)
        if undo:
            assert accum.local_gradients(model, enabled=False) is model
        else:
            model.compile(second_optimizer(), "mse")
        model.fit(x[3 * B:], y[3 * B:], batch_size=B, shuffle=False, verbose=0)
    return model


def test_compiled_again_with_adam_trains_as_keras_step():
    """After `local_gradients`, `compile(Adam)` gives back Keras's own step: `fit` trains to
    the weights of a model that never had `local_gradients`."""
    reference = trained_twice(False, lambda: keras.optimizers.Adam(1e-2))
    model = trained_twice(True, lambda: keras.optimizers.Adam(1e-2))
    assert not REPLACED & set(vars(model))
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)


def test_compiled_again_with_rescale_mode_trains_as_keras_step():
    rescale = lambda: AccumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), 3, mode="rescale")  # noqa: E731
    reference, model = trained_twice(False, rescale), trained_twice(True, rescale)
    assert not REPLACED & set(vars(model))
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)


def test_enabled_false_gives_back_keras_step():
    reference = trained_twice(False, None, undo=True)
    model = trained_twice(True, None, undo=True)
    assert not REPLACED & set(vars(model))
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)
    with pytest.raises(TypeError, match="`enabled` must be a bool. Received: enabled='no'"):
        accum.local_gradients(model, enabled="no")


def test_compiled_again_with_another_accum_optimizer_keeps_the_step():
    """No second call: the next `fit` gives the new optimizer's buffers their rows."""
    model = trained_twice(True, accum_adam)
    assert REPLACED <= set(vars(model))
    assert [tuple(b.shape) for b in model.optimizer.accumulators] == [
        (1, *w.shape) for w in model.trainable_variables]
    reference = trained_twice(False, accum_adam)
    assert_all_close(reference.get_weights(), model.get_weights(), rtol=1e-6)


def test_docstring_does_not_ask_for_a_second_call():
    assert "Call it again" not in accum.local_gradients.__doc__
