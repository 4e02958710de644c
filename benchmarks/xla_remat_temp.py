"""Does XLA shrink its compiled temporary buffer for recomputation? (JAX, any XLA device.)

    python -m benchmarks.xla_remat_temp                 # 2, 8, 16 blocks
    python -m benchmarks.xla_remat_temp --blocks 4,8 --rows 2048

A stack of feed-forward blocks (x + tanh(gelu(x W1)) gelu(x W1) W2, [rows, 256] ->
[rows, 1024]) is differentiated three ways: plainly, with every block under
`jax.checkpoint`, and with every block a `jax.custom_vjp` whose backward pass
recomputes the block only after an `optimization_barrier` ties its inputs to
the incoming cotangent (so the recomputation cannot be scheduled before the
backward pass reaches the block). For each, the jitted gradient's
`memory_analysis().temp_size_in_bytes` is printed, with the gradients checked
equal. JAX's saved residuals shrink under both recomputing variants (see
`benchmarks.recompute_memory --backend jax`); whether XLA's temp does is what
this measures.
"""

import argparse
import os
import sys

from . import harness

TOOL = "benchmarks.xla_remat_temp"


def block(params, x):
    import jax
    import jax.numpy as jnp

    w1, w2 = params
    h = jax.nn.gelu(x @ w1)
    return x + (jnp.tanh(h) * h) @ w2


def barrier_remat(f):
    """`f` recomputed in the backward pass only once the cotangent exists."""
    import jax

    @jax.custom_vjp
    def g(params, x):
        return f(params, x)

    def fwd(params, x):
        return f(params, x), (params, x)

    def bwd(saved, cotangent):
        saved, cotangent = jax.lax.optimization_barrier((saved, cotangent))
        return jax.vjp(f, *saved)[1](cotangent)

    g.defvjp(fwd, bwd)
    return g


VARIANTS = {
    "plain": lambda f: f,
    "jax.checkpoint": lambda f: __import__("jax").checkpoint(f),
    "barrier custom_vjp": barrier_remat,
}


def temp_bytes(variant, blocks, rows):
    """(temp bytes of the compiled gradient, the gradients) for `blocks` blocks of `variant`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = [(jnp.asarray(rng.normal(size=(256, 1024)), jnp.float32) * 0.03,
               jnp.asarray(rng.normal(size=(1024, 256)), jnp.float32) * 0.03) for _ in range(blocks)]
    x = jnp.asarray(rng.normal(size=(rows, 256)), jnp.float32)
    wrapped = VARIANTS[variant](block)

    def loss(params, x):
        for p in params:
            x = wrapped(p, x)
        return jnp.sum(x ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled(params, x)


def main(argv=None):
    parser = argparse.ArgumentParser(prog=f"python -m {TOOL}", description=__doc__.split("\n\n")[2])
    parser.add_argument("--blocks", type=harness.int_list, default=[2, 8, 16],
                        help="comma-separated block counts (default 2,8,16)")
    parser.add_argument("--rows", type=harness.positive_int, default=4096, help="rows of x (default 4096)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    progress = harness.Progress(TOOL)
    print(f"XLA temp buffer of the jitted gradient, MiB (device: {jax.default_backend()}, rows {args.rows})")
    print(f"{'blocks':>6} " + " ".join(f"{name:>20}" for name in VARIANTS))
    for blocks in args.blocks:
        progress(f"{blocks} blocks: compiling {len(VARIANTS)} variants")
        sizes, grads = [], []
        for variant in VARIANTS:
            size, grad = temp_bytes(variant, blocks, args.rows)
            sizes.append(size)
            grads.append(grad)
        for other in grads[1:]:
            for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(other)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        print(f"{blocks:>6} " + " ".join(f"{s / harness.MiB:>20.1f}" for s in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
