"""The core install: `recompute` and `accum` import only TensorFlow, Keras and NumPy
(on Keras's TensorFlow backend: JAX and keras-hub only where a program uses them).

The tools' dependencies (safetensors for the converter, matplotlib for the
batch-fit plot, the MiniLM weights package) are extras; the library must run
without them. Keras itself imports matplotlib when it happens to be installed,
so "not imported" is checked by making these modules unimportable in a fresh
process: an import of any of them from our packages then fails.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL_ONLY = ["matplotlib", "safetensors", "all_minilm_l6_v2", "tokenizers", "sklearn", "torch",
             "jax", "keras_hub", "tensorflow_text"]

_PROBE = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ModuleNotFoundError(f"blocked for this test: {{name}}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    {imports}
    print("ok")
    """
)


def _run(imports, env=None):
    code = _PROBE.format(blocked=set(TOOL_ONLY), imports=imports)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )


@pytest.mark.parametrize(
    "imports",
    [
        "import recompute, accum",
        "import recompute.bert4keras",
        "import keras, recompute, accum; from recompute import recompute_grad; from accum import AccumOptimizer",
    ],
)
def test_library_imports_without_the_tools_dependencies(imports):
    result = _run(imports)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_the_probe_can_fail():
    # The blocker really blocks: importing a tool-only module through it fails.
    result = _run("import safetensors")
    assert result.returncode != 0 and "blocked for this test" in result.stderr


def test_the_install_holds_no_torch_and_no_nvidia_library():
    """README's install (the `[test]` extra included: JAX's CUDA plugin, without its
    `with-cuda` extra, for `benchmarks.gpu_plan`) brings no torch and no NVIDIA library."""
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    assert "torch" not in names
    assert not {n for n in names if n.startswith("nvidia-")}, sorted(names)
