"""Does XLA keep a checkpointed block's inputs in host memory? A probe of JAX's offloading policy.

    python -m benchmarks.offload_probe --target h100     # XLA:GPU's plan, compiled here
    KERAS_BACKEND=jax python -m benchmarks.offload_probe  # the local device's (a GPU)

Eight residual blocks `x + gelu(x W1) W2` (hidden 256, inner 1024, 512 rows per
sample, float32), the gradient of a squared loss, compiled three ways: no
checkpoint; each block a `jax.checkpoint` (it keeps its input on the device); each
block a `jax.checkpoint` whose input is named and offloaded to pinned host memory
(`jax.checkpoint_policies.save_and_offload_only_these_names`, what an `offload=True`
of `recompute_grad` would use). For each, XLA's plan (`memory_analysis()`): device
and host temporaries in MiB at 8 and 16 samples. Offloading works where the third's
device temporaries are at most the second's and its host temporaries hold the
inputs (8 blocks x 0.5 MiB per sample).

Found 2026-11-28 (device and host temporaries, MiB, at 8 / 16 samples):

| where | no checkpoint | checkpoint | checkpoint + offload |
|---|---|---|---|
| CPU-side h100 target, jax 0.10.2 | 296 / 584 | 72 / 136 | 296 / 584, host 8 / 16 |
| a lent H200, jax 0.11.2 | 452 / 880 | 128 / 192 | 344 / 624, host 8 / 16 |

JAX's residuals are the host copies (`print_saved_residuals`), but XLA:GPU keeps
more device memory with the offloading policy than with a plain checkpoint, on
the card too, and moves only a quarter of the inputs (8 MiB of 32 at 8 samples):
so the library offers no `offload=` option (docs/limitations.md).
"""

import sys

from . import harness

TOOL = "benchmarks.offload_probe"
MiB = harness.MiB
_MODES = ("none", "checkpoint", "offload")


def plans(target=None, batches=(8, 16), blocks=8, hidden=256, inner=1024, rows=512):
    """{mode: [(batch, device temp MiB, host temp MiB), ...]} of the probe's step."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    sharding = None
    if target:
        from . import gpu_plan

        sharding = gpu_plan.target_sharding(target)
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["input"],
        offload_src="device", offload_dst="pinned_host")

    def block(w1, w2, x, named):
        if named:
            x = checkpoint_name(x, "input")
        return x + jax.nn.gelu(x @ w1) @ w2

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.float32, sharding=sharding)

    results = {}
    for mode in _MODES:
        if mode == "none":
            run = lambda w1, w2, x: block(w1, w2, x, False)  # noqa: E731
        elif mode == "checkpoint":
            run = jax.checkpoint(lambda w1, w2, x: block(w1, w2, x, False))
        else:
            run = jax.checkpoint(lambda w1, w2, x: block(w1, w2, x, True), policy=offload)

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
    args = parser.parse_args(argv)
    if args.target:
        from . import gpu_plan

        gpu_plan.prepare_environment()
    import jax

    where = f"an {args.target} target (XLA:GPU's plan)" if args.target else str(jax.devices()[0])
    print(f"{TOOL}: 8 residual blocks, gradient, on {where}; temporaries in MiB")
    print("| mode | samples | device temp | host temp |\n|---|---|---|---|")
    for mode, rows in plans(args.target).items():
        for batch, device, host in rows:
            print(f"| {mode} | {batch} | {device:.1f} | {host:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
