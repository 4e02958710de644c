"""Does XLA keep a checkpointed block's inputs in host memory? A probe of JAX's offloading policy.

    python -m benchmarks.offload_probe --target h100     # XLA:GPU's plan, compiled here
    python -m benchmarks.offload_probe --target h100 --blocks 16 --modes checkpoint,offload,library
    KERAS_BACKEND=jax python -m benchmarks.offload_probe  # the local device's (a GPU)

Eight residual blocks `x + gelu(x W1) W2` (hidden 256, inner 1024, 512 rows per
sample, float32), the gradient of a squared loss, compiled in each mode; for each,
XLA's plan (`memory_analysis()`): device and host temporaries in MiB at 8 and 16
samples. Offloading works where device temporaries fall below the plain
checkpoint's and stop growing with depth while host temporaries hold the inputs
(one block's input: 0.5 MiB per sample; 7 of the 8 are temporaries, the first is
the step's argument).

Modes: `none` (no checkpoint); `checkpoint` (each block a `jax.checkpoint`: it keeps
its input on the device); `offload` (a `jax.checkpoint` whose input is named and
offloaded to pinned host memory, `save_and_offload_only_these_names`);
`offload-nocse` (the same, `prevent_cse=False`; True is the default); `offload-dots`
(`offload_dot_with_no_batch_dims`: the matmul outputs offloaded, not the input);
`vjp` (a `jax.custom_vjp`: the forward pass runs the block and keeps
`jax.device_put(x, jax.memory.Space.Host)`, the backward pass puts it back and
differentiates the block, `jax.vjp`); `vjp-fwd` (plus an `optimization_barrier` of
the block's output with the host copy); `vjp-fwd-bwd` (plus one of the host copy
with the incoming gradient, before the copy back); `library` (plus one over the
block's gradients, weights' and input's together: `recompute.engine._jax._offloaded`,
what `recompute_grad(offload=True)` runs).

Found 2026-11-28 (device / host temporaries, MiB, at 8 and 16 samples; jax 0.10.2,
CPU-side h100 target):

| mode | 8 samples | 16 samples | 16 blocks, 8 samples |
|---|---|---|---|
| none | 296 / 0 | 584 / 0 | |
| checkpoint | 72 / 0 | 136 / 0 | 104 / 0 |
| offload | 296 / 8 | 584 / 16 | 616 / 8 |
| offload-nocse | 312 / 0 | 616 / 0 | |
| offload-dots | 312 / 32 | 624 / 64 | |
| vjp | 312 / 0 | 616 / 0 | |
| vjp-fwd | 316 / 24 | 672 / 48 | |
| vjp-fwd-bwd | 296 / 32 | 584 / 64 | |
| library | 68 / 32 | 120 / 64 | 68 / 64 |

A lent H200 (jax 0.11.2), earlier: none 452 / 880, checkpoint 128 / 192, offload
344 / 624 with host 8 / 16.

Why the offloading policy keeps more (its compiled HLO, `compiled.as_text()`): the
recomputation is not CSE'd away (each block's backward pass recomputes `x W1` from
the copy brought back), but XLA:GPU's scheduler (1) starts each device-to-host copy
in the backward pass, just before the copy back, so the device input lives through
the forward pass as in a plain checkpoint and only a couple of host buffers exist at
a time (host 8 MiB, not 32); and (2) once async copies are in the module, defers every
block's weight gradient (`dW1`, `dW2`, batched dots and reductions) to the end of the
backward pass, each keeping its two [rows, inner] operands (16 MiB each at 8 samples)
alive: the device plan climbs to the no-checkpoint one. `prevent_cse=False` and a
hand-made `custom_vjp` without barriers do the same (or worse: XLA drops the host
round trip). The library's three barriers pin each transfer and each block's
gradients: the host copy completes with the block's output, the copy back waits for
the block's incoming gradient, and the block's gradients are all computed before the
next block's backward pass starts. Then the device plan is the backward pass's working
set of one block (the copy back, the recomputed [rows, inner] activations and the
gradients' operands), flat in depth (68 MiB at 8 and at 16 blocks), with all inputs on
the host (32 / 64 MiB at 8 / 16 blocks). At 8 blocks the working set is 4 MiB under the
plain checkpoint's 72 (its 28 MiB of kept inputs minus the barriers' longer-lived
operands); the gain grows by one input per block (at 16 blocks, 68 against 104).

Not so in a Transformer block at BERT-base width: keras-hub BERT-base, 12 blocks, seq
512, float32, `python -m benchmarks.gpu_plan --policies full --cores auto --offload`:
"full" 19.5 MiB per sample on the device, offload 46.1 (host 18.0: every input). With
host copies in the module, XLA:GPU computes each block's feed-forward weight gradients
after the block's attention backward (its [seq, ffn] activations and their gradient
alive meanwhile); at 4 blocks, hidden 256, FFN 1024, seq 512, batch 4 the plan was 60.6
MiB against "full"'s 52.0, and 52.0 again with `jax.device_put` replaced by the identity
(every barrier kept). Neither `--xla_gpu_enable_latency_hiding_scheduler=false` nor
`--xla_gpu_enable_pipelined_host_offloading=true` (XLA_FLAGS) changed it, and a
`jax.checkpoint` over host-placed inputs (custom_vjp copies around it) planned 147.1.
"""

import sys

from . import harness

TOOL = "benchmarks.offload_probe"
MiB = harness.MiB
# Each mode: how each block runs (docstring); "offload" is JAX's offloading policy.
_MODES = ("none", "checkpoint", "offload", "offload-nocse", "offload-dots", "vjp", "vjp-fwd",
          "vjp-fwd-bwd", "library")


def _block_runs(blocks):
    """{mode: run(w1, w2, x)} of the probe's modes."""
    import jax
    from jax import lax
    from jax.ad_checkpoint import checkpoint_name

    from recompute.engine import _jax as engine

    def block(w1, w2, x):
        return x + jax.nn.gelu(x @ w1) @ w2

    def named(w1, w2, x):
        return block(w1, w2, checkpoint_name(x, "input"))

    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["input"],
        offload_src="device", offload_dst="pinned_host")
    dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def hand_vjp(forward_barrier, backward_barrier):
        """A custom_vjp keeping a host copy of x, with some of the library's barriers."""
        @jax.custom_vjp
        def run(w1, w2, x):
            return block(w1, w2, x)

        def forward(w1, w2, x):
            y, kept = block(w1, w2, x), jax.device_put(x, host)
            if forward_barrier:
                y, kept = lax.optimization_barrier((y, kept))
            return y, (w1, w2, kept)

        def backward(residuals, g):
            w1, w2, kept = residuals
            if backward_barrier:
                kept, g = lax.optimization_barrier((kept, g))
            return jax.vjp(block, w1, w2, jax.device_put(kept, device))[1](g)

        run.defvjp(forward, backward)
        return run

    library = engine._offloaded(lambda values, inputs: block(*values, *inputs))
    return {
        "none": block,
        "checkpoint": jax.checkpoint(block),
        "offload": jax.checkpoint(named, policy=offload),
        "offload-nocse": jax.checkpoint(named, policy=offload, prevent_cse=False),
        "offload-dots": jax.checkpoint(block, policy=dots),
        "vjp": hand_vjp(False, False),
        "vjp-fwd": hand_vjp(True, False),
        "vjp-fwd-bwd": hand_vjp(True, True),
        "library": lambda w1, w2, x: library([w1, w2], [x]),
    }


def plans(target=None, batches=(8, 16), blocks=8, hidden=256, inner=1024, rows=512, modes=_MODES):
    """{mode: [(batch, device temp MiB, host temp MiB), ...]} of the probe's step."""
    import jax
    import jax.numpy as jnp

    sharding = None
    if target:
        from . import gpu_plan

        sharding = gpu_plan.target_sharding(target)

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.float32, sharding=sharding)

    runs = _block_runs(blocks)
    results = {}
    for mode in modes:
        run = runs[mode]

        def loss(weights, x, run=run):
            for w1, w2 in weights:
                x = run(w1, w2, x)
            return (x ** 2).mean()

        weights = [(shape(hidden, inner), shape(inner, hidden))] * blocks
        results[mode] = []
        for batch in batches:
            traced = jax.jit(jax.grad(loss)).trace(weights, shape(batch * rows, hidden))
            lowered = traced.lower(lowering_platforms=("cuda",)) if target else traced.lower()
            analysis = lowered.compile().memory_analysis()
            results[mode].append((batch, analysis.temp_size_in_bytes / MiB,
                                  analysis.host_temp_size_in_bytes / MiB))
    return results


def main(argv=None):
    parser = harness.parser(TOOL, __doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="a GPU of benchmarks.gpu_plan.TARGETS")
    parser.add_argument("--blocks", type=int, default=8, help="residual blocks (default 8)")
    parser.add_argument("--modes", default=",".join(_MODES), help="comma-separated, of " + ", ".join(_MODES))
    args = parser.parse_args(argv)
    if args.target:
        from . import gpu_plan

        gpu_plan.prepare_environment()
    import jax

    where = f"an {args.target} target (XLA:GPU's plan)" if args.target else str(jax.devices()[0])
    print(f"{TOOL}: {args.blocks} residual blocks, gradient, on {where}; temporaries in MiB")
    print("| mode | samples | device temp | host temp |\n|---|---|---|---|")
    for mode, rows in plans(args.target, blocks=args.blocks, modes=args.modes.split(",")).items():
        for batch, device, host in rows:
            print(f"| {mode} | {batch} | {device:.1f} | {host:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
