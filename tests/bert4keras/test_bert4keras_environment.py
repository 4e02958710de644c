"""recompute.bert4keras.patch() refuses an environment in which bert4keras cannot load.

Checked in a subprocess: this suite itself runs with TF_KERAS=1 TF_USE_LEGACY_KERAS=1.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, os
import recompute.bert4keras as rb

results = {}
for name, env in [
    ("neither", {}),
    ("tf_keras_only", {"TF_KERAS": "1"}),
    ("legacy_only", {"TF_USE_LEGACY_KERAS": "1"}),
    ("legacy_yes", {"TF_KERAS": "1", "TF_USE_LEGACY_KERAS": "yes"}),  # TensorFlow ignores "yes"
]:
    for var in ("TF_KERAS", "TF_USE_LEGACY_KERAS"):
        os.environ.pop(var, None)
    os.environ.update(env)
    try:
        rb.patch()
        results[name] = None
    except RuntimeError as e:
        results[name] = str(e)
    finally:
        rb.unpatch()
print(json.dumps(results))
"""


def test_patch_without_the_environment_raises_clearly():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_KERAS", "TF_USE_LEGACY_KERAS")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, message in results.items():
        assert message is not None, f"patch() accepted the environment {name!r}"
        assert "`TF_KERAS=1`" in message and "`TF_USE_LEGACY_KERAS=1`" in message, message
    assert "Received: TF_KERAS=None, TF_USE_LEGACY_KERAS=None" in results["neither"]
    assert "Received: TF_KERAS='1', TF_USE_LEGACY_KERAS='yes'" in results["legacy_yes"]


def test_patch_with_the_environment_succeeds():
    """This process has the environment (the suite's command line sets it)."""
    import recompute.bert4keras as rb

    if os.environ.get("TF_KERAS") != "1" or os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        pytest.skip("run with TF_KERAS=1 TF_USE_LEGACY_KERAS=1 (see README)")
    was_patched = rb.is_patched()
    rb.patch()
    assert rb.is_patched()
    if not was_patched:
        rb.unpatch()
