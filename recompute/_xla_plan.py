"""XLA's memory plan of a JAX step: compiled, not run, for this machine's device or for a GPU
this machine does not have.

`recompute.plan(..., memory="plan")` (the default on Keras's JAX backend) and
`benchmarks.gpu_plan` read it here. A compiled executable's `memory_analysis()` gives the
buffers XLA assigned: the arguments, the outputs, the outputs that alias donated arguments,
and the temporary buffer (the activations kept for the backward pass and the working set of
both passes). A step whose state is donated (what `model.fit` jits) needs at its peak

    arguments + outputs - aliases + temp

bytes of device memory, before the allocator's own overhead and fragmentation.

For a target (`TARGETS`: "h100", "a100-40", "l4", "rtx4090"), the step is lowered and
compiled by XLA:GPU through JAX's CUDA plugin (`jax-cuda12-pjrt` and `jax-cuda12-plugin` of
jax's exact version, installed with --no-deps; no NVIDIA library, no driver, no GPU) for a
one-device topology described by the card's facts (a `GpuTargetConfigProto`). The CUDA
platform must be named before JAX starts: `prepare_environment()` sets
`JAX_PLATFORMS=cpu,cuda` and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, and refuses a process
whose JAX started without them.

Two private names are read here, listed in `PRIVATE_NAMES` (the format of
`recompute.adapters._keras_private`'s; tests/recompute_jax/test_private_interface_jax.py checks
them on the installed versions): whether JAX has started its backends (JAX's
`xla_bridge`), and Keras's `Model._symbolic_build`, which builds what `fit` builds
before its first step.
"""

import os
import sys

PRIVATE_NAMES = (
    ("backends_are_initialized", ("jax._src.xla_bridge",)),
    ("_symbolic_build", ("keras.Model",)),
)

# Each card's facts as XLA:GPU reads them (`stream_executor.GpuTargetConfigProto`):
# the data sheet's numbers (SMs, L2, memory, clocks, compute capability).
_CARD = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core} shared_memory_per_block_optin: {smem_optin}
  threads_per_core_limit: {threads_core} core_count: {sms} fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: {l2} clock_rate_ghz: {clock}
  device_memory_size: {memory}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", sms=132, fpus=128, major=9, minor=0,
                 l2=52428800, memory=84978434048, bandwidth=3352320000000, clock=1.98,
                 smem_core=233472, smem_optin=232448, threads_core=2048),
    "a100-40": dict(name="NVIDIA A100-SXM4-40GB", sms=108, fpus=64, major=8, minor=0,
                    l2=41943040, memory=42331013120, bandwidth=1555200000000, clock=1.41,
                    smem_core=167936, smem_optin=166912, threads_core=2048),
    "l4": dict(name="NVIDIA L4", sms=58, fpus=128, major=8, minor=9, l2=50331648,
               memory=23580639232, bandwidth=300000000000, clock=2.04, smem_core=102400,
               smem_optin=101376, threads_core=1536),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", sms=128, fpus=128, major=8, minor=9,
                    l2=75497472, memory=25386352640, bandwidth=1008000000000, clock=2.52,
                    smem_core=102400, smem_optin=101376, threads_core=1536),
}
ENV = {"JAX_PLATFORMS": "cpu,cuda", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def check_target(target):
    if target not in TARGETS:
        raise ValueError(f"`target` must be one of {', '.join(sorted(TARGETS))} (a GPU XLA "
                         f"plans for without one). Received: target={target!r}")
    return target


def _jax_started():
    """Whether JAX has initialized its backends (after which its platforms are fixed)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def environment_ready():
    """Whether JAX has not started its backends yet, or started them with the CUDA platform
    named (`ENV`)."""
    return not _jax_started() or all(os.environ.get(k) == v for k, v in ENV.items())


def prepare_environment(tool="recompute.plan"):
    """Names the CUDA platform for JAX (before JAX starts its backends: importing jax is not
    starting it) and selects Keras's JAX backend for a Keras not imported yet; a RuntimeError
    if JAX has started without the platform."""
    if not environment_ready():
        raise RuntimeError(
            f"{tool} needs JAX started with " + ", ".join(f"{k}={v}" for k, v in ENV.items())
            + f": run it in a fresh process ({'python -m ' + tool if '.' in tool else tool}), "
            "or set them before JAX's first computation. Received: JAX already started with "
            + ", ".join(f"{k}={os.environ.get(k)!r}" for k in ENV))
    os.environ.update(ENV)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if "jax" in sys.modules:  # imported (TensorFlow imports it) but not started
        import jax

        jax.config.update("jax_platforms", ENV["JAX_PLATFORMS"])


def rerun_with_environment(module, argv, force_backend=False):
    """Runs `python -m module *argv` again in this process's place (`os.execve`) with `ENV`
    and KERAS_BACKEND=jax set, unless this process has them and Keras (if imported) runs on
    JAX: for a command's `__main__` block, whose package imports started Keras (on
    TensorFlow's backend) before it could name the CUDA platform. A KERAS_BACKEND other than
    jax set by the user is kept (for the command to refuse) unless `force_backend`."""
    if os.environ.get("KERAS_BACKEND", "jax") != "jax" and not force_backend:
        return
    want = dict(ENV, KERAS_BACKEND="jax")
    keras_on_jax = "keras" not in sys.modules or sys.modules["keras"].backend.backend() == "jax"
    if keras_on_jax and all(os.environ.get(k) == v for k, v in want.items()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], dict(os.environ, **want))


def target_sharding(target, tool="recompute.plan"):
    """The sharding of one device of `target` (a name of `TARGETS`): what a step's abstract
    arguments carry so that `jax.jit` lowers and compiles for that GPU."""
    check_target(target)
    if not environment_ready():
        prepare_environment(tool)  # raises: JAX started without the CUDA platform
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=_CARD.format(**TARGETS[target]), topology="1x1x1")
    except Exception as e:  # the plugin is missing or cannot compile for CUDA here
        raise RuntimeError(
            f"{tool}: JAX cannot compile for a CUDA target here: install jax-cuda12-pjrt and "
            "jax-cuda12-plugin of jax's exact version with --no-deps (the [test] extra), and "
            "start JAX with " + ", ".join(f"{k}={v}" for k, v in ENV.items())
            + f". Received: {type(e).__name__}: {e}") from e
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def _abstract(tree, sharding):
    import jax

    def one(x):
        if sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def compile_step(fn, args, sharding=None, donate_argnums=(), text=False):
    """`fn(*args)` (arrays or shapes) compiled by XLA: for a target's device (`sharding` from
    `target_sharding`), or for JAX's default device when `sharding` is None.

    Returns (compiled, plan): the executable (runnable on the local device only) and a dict
    of its planned bytes -- temp, arguments, outputs, aliases (outputs in donated
    arguments), peak (arguments + outputs - aliases + temp), all the device's, and host_temp
    (temporaries in host memory: what `recompute_grad(offload=True)` keeps there) -- plus the optimized module's
    text with `text=True`."""
    import jax

    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    if sharding is None:
        lowered = jitted.lower(*_abstract(args, None))
    else:  # a target's device: lowered for CUDA whatever this machine has
        lowered = jitted.trace(*_abstract(args, sharding)).lower(lowering_platforms=("cuda",))
    compiled = lowered.compile()
    analysis = compiled.memory_analysis()
    plan = {"temp": int(analysis.temp_size_in_bytes),
            "arguments": int(analysis.argument_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes),
            "aliases": int(getattr(analysis, "alias_size_in_bytes", 0) or 0),
            "host_temp": int(getattr(analysis, "host_temp_size_in_bytes", 0) or 0)}
    plan["peak"] = plan["arguments"] + plan["outputs"] - plan["aliases"] + plan["temp"]
    if text:
        plan["hlo"] = compiled.as_text()
    return compiled, plan


def compile_plan(fn, args, sharding):
    """`fn(*args)` (arrays or shapes) compiled by XLA:GPU for `sharding`'s device: a dict of
    its planned bytes (temp, arguments, outputs, aliases, peak) and the optimized module's
    text (`hlo`)."""
    return compile_step(fn, args, sharding, text=True)[1]


# --------------------------------------------------------------------------
# Keras's own JAX training step.


def train_state(model):
    """The state Keras's JAX `train_step` takes (what `fit` passes, donated): the values of
    the trainable, non-trainable, optimizer and metrics variables."""
    return ([v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables])


def build_for_training(model, x, y):
    """Builds what `fit` builds before its first step (the optimizer's and the compiled
    metrics' variables), for a step traced outside `fit`."""
    if getattr(model, "_symbolic_build", None) is not None:
        try:
            model._symbolic_build(data_batch=(x, y, None))
            return
        except TypeError:
            pass
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def train_step_plan(model, x, y, sharding=None):
    """XLA's plan of Keras's JAX training step of `model` on the batch (x, y):
    `model.train_step(state, (x, y, None))` jitted with the state donated, as `fit` does,
    compiled for `sharding`'s device (a target's) or the local default device (None).

    Returns (compiled, plan) as `compile_step`. Trace it inside `recompute_scope` for a
    recomputation policy."""
    build_for_training(model, x, y)
    return compile_step(model.train_step, (train_state(model), (x, y, None)), sharding,
                        donate_argnums=0)


def run_step(model, compiled, x, y):
    """Runs a `train_step_plan` executable (compiled for the local device) once on (x, y),
    and writes the new state back into the model's variables (the old one was donated)."""
    import jax

    logs, state = compiled(train_state(model), (x, y, None))
    for variables, values in zip((model.trainable_variables, model.non_trainable_variables,
                                  model.optimizer.variables, model.metrics_variables), state):
        for v, value in zip(variables, values):
            v.assign(value)
    jax.block_until_ready(state)
    return logs
