"""benchmarks.offload_probe compiles its steps for an H100 target here (no GPU) and
prints XLA's plans; benchmarks/device_check.sh, the prepared run for a lent GPU, is valid
bash and names only tools that exist."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # compiles every mode for XLA:GPU in a fresh process
def test_probe_plans_every_mode_for_a_target():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.offload_probe", "--target", "h100"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = re.findall(r"^\| ([a-z-]+) \| (8|16) \| ([0-9.]+) \| ([0-9.]+) \|$", proc.stdout, re.M)
    assert len(rows) == 18, proc.stdout
    temp = {(mode, int(batch)): float(device) for mode, batch, device, _ in rows}
    host = {(mode, int(batch)): float(h) for mode, batch, _, h in rows}
    # XLA:GPU's plan: a checkpoint keeps less than no checkpoint (what the probe compares with)
    assert temp["checkpoint", 16] < temp["none", 16]
    # the library's offload (recompute_grad(offload=True)): below the plain checkpoint on the
    # device, every block's input but the first (an argument) on the host: 7 x 0.5 MiB a sample
    for batch in (8, 16):
        assert temp["library", batch] < temp["checkpoint", batch], proc.stdout
        assert host["library", batch] >= 7 * 0.5 * batch, proc.stdout


def test_device_check_script_is_valid_and_names_existing_tools():
    script = os.path.join(ROOT, "benchmarks", "device_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    for tool in set(re.findall(r"-m benchmarks\.(\w+)", text)):
        assert os.path.exists(os.path.join(ROOT, "benchmarks", tool + ".py")), tool
