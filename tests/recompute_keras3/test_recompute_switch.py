"""recompute_grad on Keras 3: the RECOMPUTE switch, and nothing extra when off or without a tape."""

import numpy as np
import pytest
import tensorflow as tf

import recompute
from tests.helpers.k3_blocks import CALLS, Block, PlainBlock, build_model, inputs, train_grads, _graph_op_types


def test_env_variable_read_at_call_time(monkeypatch):
    x = inputs()
    model = build_model()
    monkeypatch.setenv("RECOMPUTE", "0")
    CALLS["n"] = 0
    train_grads(model, x, "eager", steps=1)
    assert CALLS["n"] == 3
    monkeypatch.setenv("RECOMPUTE", "yes")
    CALLS["n"] = 0
    train_grads(model, x, "eager", steps=1)
    assert CALLS["n"] == 6
    monkeypatch.setenv("RECOMPUTE", "maybe")
    with pytest.raises(ValueError, match="maybe"):
        train_grads(model, x, "eager", steps=1)


def test_no_tape_runs_once():
    model = build_model()
    with recompute.recompute_scope(True):
        CALLS["n"] = 0
        model(inputs(), training=True)
        assert CALLS["n"] == 3
        model.predict(np.zeros((4, 8), "float32"), verbose=0)


def test_disabled_adds_no_ops():
    x = inputs()
    decorated, plain = build_model(Block), build_model(PlainBlock)
    with recompute.recompute_scope(False):
        assert _graph_op_types(decorated, x, True) == _graph_op_types(plain, x, True)
    with recompute.recompute_scope(True):
        assert _graph_op_types(decorated, x, True) != _graph_op_types(plain, x, True)

    @tf.function
    def infer(x):
        return decorated(x, training=False)

    @tf.function
    def infer_plain(x):
        return plain(x, training=False)

    with recompute.recompute_scope(True):  # no tape: nothing added either
        a = sorted(op.type for op in infer.get_concrete_function(x).graph.get_operations())
        b = sorted(op.type for op in infer_plain.get_concrete_function(x).graph.get_operations())
    assert a == b


def test_scope_overrides_environment(monkeypatch):
    monkeypatch.setenv("RECOMPUTE", "1")
    assert recompute.is_enabled()
    with recompute.recompute_scope(False):
        assert not recompute.is_enabled()
        with recompute.recompute_scope(True):
            assert recompute.is_enabled()
        assert not recompute.is_enabled()
    with pytest.raises(TypeError, match="Received: enabled='yes'"):
        with recompute.recompute_scope("yes"):
            pass
