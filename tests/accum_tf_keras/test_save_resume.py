"""tf_keras: a model compiled with `AccumOptimizer` (new-style and legacy inner optimizers),
saved mid-window (7 micro-steps, k=4), loads in a fresh process (`import tf_keras`,
`import accum` only) and finishes bit-exactly like the uninterrupted run, for
Sequential, functional and subclassed models:

- `.keras`, `.h5` (Sequential and functional: tf_keras writes no `.h5` for
  subclassed models) through `load_model`;
- SavedModel (`model.save(dir, save_format="tf")`): tf_keras's `load_model`
  restores the weights and the optimizer's config, never an optimizer's state
  (tf_keras's design, every optimizer); the state is in the SavedModel's
  checkpoint: `model.optimizer.build(model.trainable_variables)`, then
  `model.load_weights(dir + "/variables/variables")` resumes bit-exactly;
- `save_weights` in the TensorFlow checkpoint format and `.weights.h5`, loaded with
  `load_weights` into a freshly built model and optimizer.

tf_keras saves no state of legacy optimizers (`tf_keras.optimizers.legacy.*`, plain
or wrapped) in `.keras` and `.weights.h5` files: it visits only new-style
optimizers. There the weights come back and the optimizer starts fresh (tested
below); resume legacy optimizers from `.h5`, SavedModel or a TF checkpoint.

The worker is `tests/save_resume_worker.py` (one process for every case)."""

import numpy as np
import pytest

from tests.helpers import save_resume_checks as checks
from tests.helpers import save_resume_worker as worker

KINDS = ("sequential", "functional", "subclassed")
FORMATS = {
    "sequential": ["keras", "h5", "savedmodel", "ckpt", "weights"],
    "functional": ["keras", "h5", "savedmodel", "ckpt", "weights"],
    "subclassed": ["keras", "savedmodel", "ckpt", "weights"],
}
PLAN = {(spec, kind): FORMATS[kind] for spec in ("adam", "legacy_adam") for kind in KINDS}
PLAN[("momentum", "sequential")] = ["keras", "h5"]
PLAN[("rescale", "functional")] = ["keras", "h5"]
CASES = checks.cases(PLAN)
NO_OPTIMIZER_STATE = [c for c in CASES if c[0] == "legacy_adam" and c[2] in ("keras", "weights")]
RESUMED = [c for c in CASES if c not in NO_OPTIMIZER_STATE]


def test_new_style_optimizer_variable_names_are_unique_for_h5(tmp_path):
    """`.h5` stores optimizer variables by name: the wrapper's micro-step counter is
    `micro_steps`, not the inner optimizer's `iteration`."""
    model = worker.compiled_model("tf_keras", "sequential", "adam", seed=0)
    worker.train(model, 0, worker.STOP)
    names = [v.name for v in model.optimizer.variables]
    assert len(set(names)) == len(names), names
    model.save(tmp_path / "m.h5")
    weights = [v.numpy() for v in model.optimizer.variables]
    with pytest.raises(ValueError, match=rf"expected {len(weights)} weights .* Received: {len(weights) - 1} weights"):
        model.optimizer.set_weights(weights[:-1])
    model.optimizer.set_weights(weights)


saved_and_resumed = checks.saved_and_resumed_fixture("tf_keras", PLAN)


@pytest.mark.parametrize("case", RESUMED, ids=checks.ids(RESUMED))
def test_resume_in_fresh_process_is_bit_exact(saved_and_resumed, case):
    # the pending window is in the buffers (after 3 counters)
    buffers_at = None if case[0] in ("momentum", "rescale") else 3
    checks.check_resumed_mid_window(saved_and_resumed, case, buffers_at)


@pytest.mark.parametrize("case", NO_OPTIMIZER_STATE, ids=checks.ids(NO_OPTIMIZER_STATE))
def test_legacy_keras_format_restores_weights_not_optimizer_state(saved_and_resumed, case):
    cases, result = saved_and_resumed
    saved, _, job = cases[case]
    assert not [f for f in result["failures"] if f.startswith(" ".join(("tf_keras",) + case) + ":")]
    at_load = worker.load_state(job["out"] + ".at_load.npz")
    assert all(np.array_equal(a, b) for a, b in zip(saved["weights"], at_load["weights"]))
    assert list(at_load["counters"]) == [0, 0, 0]
    assert not any(np.any(v) for v in at_load["optimizer"])
