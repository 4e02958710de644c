"""`accum.local_gradients` on 4 virtual CPU devices (tests.helpers.local_gradients_worker,
one process for all checks): batches that do not split over the shards are refused in
Keras's terms -- before training where `fit` knows the data's size (arrays), and at the
batch for a dataset's last partial batch -- and `mixed_float16` (Keras's
`LossScaleOptimizer` around the `AccumOptimizer`) trains as Keras's step does."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# float16 gradients all-reduced in float16 (Keras's step) and summed as float32 rows (local):
# measured 1.2e-4 after 2 Adam updates (jax 0.10, XLA:CPU).
TOL_MIXED = 1e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("local_gradients") / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.local_gradients_worker", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND="jax", CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def refused(results, check):
    result = results[check]
    assert isinstance(result, dict) and result.get("error") == "ValueError", result
    assert "needs every batch to split evenly over the 4 shards of the batch axis 'batch'" in result["message"], result
    return result["message"]


def test_batch_size_not_a_multiple_of_the_shards_is_refused_before_training(results):
    message = refused(results, "batch_size_not_a_multiple")
    assert message.startswith("trained=False: ") and message.endswith("Received: batch_size=6"), message


def test_a_partial_last_batch_of_arrays_is_refused_before_training(results):
    message = refused(results, "last_batch_not_a_multiple")
    assert message.startswith("trained=False: "), message
    assert "Received: 18 training samples in batches of 8: each epoch's last batch would hold 2" in message
    assert "train on the first 16 samples" in message


def test_a_partial_last_batch_of_a_dataset_is_refused_in_keras_terms(results):
    """The two full batches trained (2 micro-steps); the third, of 2 samples, is refused
    with what happened and what to do, JAX's error attached."""
    message = refused(results, "last_batch_of_a_dataset")
    assert message.startswith("trained=False micro_steps=2: "), message
    assert "last, partial batch of an epoch" in message and "drop_remainder=True" in message
    assert "the dimension size is 2" in message  # JAX's, in "Received:"


def test_train_on_batch_not_a_multiple_is_refused(results):
    assert refused(results, "train_on_batch_not_a_multiple").endswith("Received: a batch of 6 samples")


def test_mixed_float16_matches_keras_step_on_four_shards(results):
    """Keras wraps the AccumOptimizer in a LossScaleOptimizer: the same loss scale, update
    and micro-step counts as Keras's step (no step skipped that Keras's did not skip), the
    buffers with one row per shard, and the weights to float16 rounding."""
    result = results["mixed_float16_matches_keras_step"]
    assert "error" not in result, result
    (keras_scale, keras_updates, keras_micro, keras_shapes) = result["keras"]
    (scale, updates, micro, shapes) = result["local"]
    assert (scale, updates, micro) == (keras_scale, keras_updates, keras_micro) == (32768.0, 2, 6)
    assert shapes == [[4, *shape] for shape in keras_shapes]
    assert result["difference"] < TOL_MIXED, result


def test_outside_the_scope_names_the_mesh_of_the_model(results):
    result = results["outside_the_scope"]
    assert result.get("error") == "ValueError", result
    assert "inside the `with distribution.scope():`" in result["message"], result
    assert "The model's variables lie on a mesh {'batch': 4}" in result["message"], result
