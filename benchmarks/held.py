"""What a TensorFlow training step holds at its peak, read from TensorFlow's allocation log.

    python -m benchmarks.recompute_memory --model standard --modes attention --held

`benchmarks.recompute_memory --held` runs each worker with `ENV`
(`TF_CPP_VMODULE=log_memory=2`): TensorFlow then writes every tensor's allocation (with the
name of the op that made it, its shape and its bytes) and every release to its C++ log,
file descriptor 2. The worker sends that log to a file (`capture`; its progress lines
stay on the original stderr), marks the start of its last measured step (`mark`), and
`peak(lines)` replays that step: the tensors allocated in it and alive together at their
largest, in bytes, grouped by the name of the op that made each (its digits as `#`, so
that one op of every block is one group: `encoder_#/block_#_#/ffn_in_#/Tensordot/MatMul`).
`per_sample(low, high, batches)` gives each group's growth per sample between two batch
sizes: which tensors make the per-sample figure.

What it counts: tensors made in the step, by their allocated bytes. Not counted: what
was alive before the step (weights, optimizer slots), allocations that are not tensors
(an op's scratch space), the allocator's rounding; so the peak reads a little below the
allocator's figure at the same step. Nor is a tensor made before the step and freed in
it subtracted, as the allocator's figure (its peak less what was in use before the step)
does: where a step makes a tensor anew in place of one of those (tf_keras's optimizer
updates, which read every weight into a new tensor), the log can put its peak there and
read above the allocator. Logging every allocation slows the step several
times: take CPU times from a run without `--held`. Figures: docs/attention.md.
"""

import collections
import os
import re
import sys

from .harness import MiB

ENV = {"TF_CPP_VMODULE": "log_memory=2", "TF_CPP_MIN_LOG_LEVEL": "0"}
MARK = "=== benchmarks.held: the step measured from here ==="

_ALLOCATION = re.compile(
    r'MemoryLogTensorAllocation \{.*?kernel_name: "([^"]*)".*?allocation_description \{'
    r'.*?allocated_bytes: (\d+).*?allocation_id: (\d+)')
_RELEASE = re.compile(r'MemoryLogTensorDeallocation \{.*?allocation_id: (\d+)')


def capture(path):
    """Sends file descriptor 2 (TensorFlow's C++ log) to the file `path`; Python's
    `sys.stderr` (progress lines, tracebacks) stays on the original stderr. Call it before
    TensorFlow is imported."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr.flush()
    sys.stderr = os.fdopen(saved, "w", buffering=1)


def mark():
    """Marks, in the captured log, the start of the step `peak` replays."""
    os.write(2, (MARK + "\n").encode())


def group_of(op_name):
    """The group of a tensor made by the op `op_name`: the name with its digits as `#`."""
    return re.sub(r"\d+", "#", op_name)


def peak(lines):
    """`dict(peak_bytes=..., groups={group: [bytes, tensors]})`: the tensors allocated after
    the last `MARK` line of `lines` (TensorFlow's allocation log, read once, line by line)
    and alive together at their largest, their bytes and count per `group_of` their op.
    Raises ValueError where `lines` has no `MARK` or no allocation after it."""
    marked, live, now, top, at_top = False, {}, 0, 0, {}
    for line in lines:
        if MARK in line:  # a later mark starts the replay again
            marked, live, now, top, at_top = True, {}, 0, 0, {}
        elif not marked:
            continue
        elif "MemoryLogTensorAllocation" in line:
            m = _ALLOCATION.search(line)
            if m is None or int(m.group(3)) in live:
                continue
            live[int(m.group(3))] = (int(m.group(2)), m.group(1))
            now += int(m.group(2))
            if now > top:
                top, at_top = now, dict(live)
        elif "MemoryLogTensorDeallocation" in line:
            m = _RELEASE.search(line)
            if m is not None and int(m.group(1)) in live:
                now -= live.pop(int(m.group(1)))[0]
    if not marked:
        raise ValueError(f"the allocation log has no line {MARK!r}: was the step marked?")
    if not at_top:
        raise ValueError("the allocation log has no tensor allocated after its mark: was it "
                         f"captured with {' '.join(f'{k}={v}' for k, v in ENV.items())}?")
    groups = collections.defaultdict(lambda: [0, 0])
    for size, op in at_top.values():
        groups[group_of(op)][0] += size
        groups[group_of(op)][1] += 1
    return dict(peak_bytes=top, groups=dict(groups))


def read(path):
    """`peak` of the log file `path`."""
    with open(path, errors="replace") as f:
        return peak(f)


def per_sample(low, high, batches):
    """{group: bytes per sample}: each group's growth between `low` and `high` (`peak`'s
    results at the two batch sizes `batches`), largest first; a group missing at one size
    counts 0 there."""
    span = batches[1] - batches[0]
    names = set(low["groups"]) | set(high["groups"])
    growth = {g: (high["groups"].get(g, [0])[0] - low["groups"].get(g, [0])[0]) / span
              for g in names}
    return dict(sorted(growth.items(), key=lambda kv: -abs(kv[1])))


def print_report(held_by_mode, batches, out, rows=12):
    """Per mode, the peak at each batch size, its slope per sample and the `rows` groups
    that grow most (MiB per sample, tensors at the larger batch). `held_by_mode`:
    {mode: {batch: peak's result}}."""
    p = lambda *a: print(*a, file=out)  # noqa: E731
    low, high = batches[0], batches[-1]
    p("")
    p("held at the peak of the last measured step (--held: TensorFlow's allocation log, the "
      "tensors made in the step, grouped by the op that made them)")
    for mode, held in held_by_mode.items():
        slope = (held[high]["peak_bytes"] - held[low]["peak_bytes"]) / (high - low)
        p(f"mode {mode}: " + ", ".join(f"batch {b}: {held[b]['peak_bytes'] / MiB:.1f} MiB"
                                       for b in (low, high))
          + f"; {slope / MiB:.1f} MiB per sample")
        for group, size in list(per_sample(held[low], held[high], (low, high)).items())[:rows]:
            count = held[high]["groups"].get(group, [0, 0])[1]
            p(f"  {size / MiB:>8.2f} MiB/sample {count:>4} tensors  {group}")
