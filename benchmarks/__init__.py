"""Benchmarks of `recompute` and `accum`: tools run from a checkout, not installed.

Each tool runs with `python -m benchmarks.<name>` from the repository root
(`--help` lists its options, `--quick` is a small smoke run, `--json PATH`
saves the figures):

- `python -m benchmarks.recompute_memory`: activation memory (TensorFlow's
  allocator peak per step), peak RSS and CPU time per step of a
  BERT-base-shaped Keras 3 encoder with `RECOMPUTE=0` vs `1`; per-sample
  memory as the slope between batch sizes; each configuration in a fresh
  process (`--paired`: every configuration in one process, a step of each in
  turn, for time ratios under one load). `--backend jax`: the standard
  encoder on Keras 3's JAX backend, measured by JAX's saved residuals and
  XLA's compiled temp buffer. `--held`: what the step holds at its peak,
  from TensorFlow's allocation log, by the op that made each tensor
  (`held`).
- `python -m benchmarks.peer`: the same BERT-base classifier through the
  project (keras-hub's `BertBackbone` or the standard Keras 3 block, every
  policy, on the Keras backend at hand) and, where torch and transformers
  are importable already, Hugging Face BERT (sdpa and eager attention, with
  and without gradient checkpointing): MiB per sample, memory and step-time
  ratios within each framework, the batch in a budget, first losses.
- `python -m benchmarks.gpu_plan`: XLA:GPU's memory plan of the JAX training
  step (keras-hub BERT or the standard Keras 3 block) for an H100 (A100-40,
  L4, RTX 4090) compiled on any machine, no GPU needed, per policy and
  attention core: temp MiB per sample, arguments, outputs, loops and softmax
  passes per layer (docs/attention.md).
- `python -m benchmarks.attention_seq`: activation memory per sample of the
  standard Keras 3 block against the sequence length, per policy (through
  `recompute_memory`); a table and a PNG (docs/attention.md).
- `python -m benchmarks.lm_memory`: activation memory and time of a keras-hub
  causal LM at real widths (Gemma-2B, Gemma-7B, Llama-7B) with LoRA, per
  policy, over a few blocks and projected to the real model
  (docs/keras_hub.md); `--backend jax`: JAX's saved residuals; `--paired`:
  time ratios in one process.
- `KERAS_BACKEND=jax python -m benchmarks.lm_step`: one whole LoRA training
  step of the real model (every block, the real vocabulary, bfloat16) per
  policy, and with `recompute.keras_hub.chunked_loss`, on JAX (Keras's own
  `train_step`): XLA's plan and the accelerator allocator's peak (the GPU
  question of docs/keras_hub.md); `--target h100`: XLA:GPU's plan compiled
  here, the weights never made.
- `python -m benchmarks.offload_probe`: whether XLA keeps checkpointed blocks'
  inputs in host memory under JAX's offloading policy (device and host
  temporaries of a small residual stack; `--target h100` or the local GPU).
- `bash benchmarks/device_check.sh OUT`: the prepared run for a lent GPU
  machine (the offload probe, the planner's check, peer's "full" row; lm_step at
  Gemma-7B and 2B when named), each section time-limited; `DEVICE_CHECK_TINY=1`
  runs it in minutes anywhere.
- `python -m benchmarks.lm_head`: peak memory and CPU time of one training
  step of a keras-hub causal LM with full logits against
  `recompute.keras_hub.chunked_loss`, paired in one process (TensorFlow;
  docs/keras_hub.md).
- `python -m benchmarks.accum_local_jax`: floats all-reduced and time per
  update of Keras's JAX step against `accum.local_gradients` on virtual
  devices (docs/distribution.md).
- `python -m benchmarks.xla_remat_temp`: whether XLA's compiled temp buffer
  shrinks when blocks are recomputed (`jax.checkpoint`, and a recomputation
  that waits for the cotangent); JAX only.
- `TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m benchmarks.batchfit`:
  `recompute.plan` measured on a bert4keras BERT (base, large, the real
  MiniLM): the policy, micro-batch and accumulation steps it chooses within a
  memory budget and what the plan cost; a table and a plot. `--quick` ends with the
  fine-tuning example (`examples/bert_finetune.py`) run with
  `--recompute --accum-steps 4`.
- `TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python -m benchmarks.cpu_split`: where
  a training step's CPU time goes -- user and system seconds, page faults,
  peak RSS per sample -- per mode and batch of `batchfit`'s model (optionally
  with fewer blocks), with glibc's default malloc, huge pages or TensorFlow's
  own pool (`--malloc`); `--paired` times several configurations in one
  process, a step of each in turn.
- `python -m benchmarks.recompute_distribute`: per-replica activation memory
  and CPU time with `RECOMPUTE=0` vs `1` under `MultiWorkerMirroredStrategy`
  (2 processes on loopback) or `MirroredStrategy` (2 logical CPUs).
- `python -m benchmarks.accum_state`: optimizer-state bytes and time per
  micro-step of `AccumOptimizer` (buffer and momentum modes) against Adam and
  Keras's `gradient_accumulation_steps`, on BERT-base's parameter shapes.
- `python -m benchmarks.accum_distribute`: all-reduce rounds and bytes, wall
  and CPU time per effective batch of `AccumOptimizer` on 2
  `MultiWorkerMirroredStrategy` workers, against all-reducing every
  micro-step.
- `python -m benchmarks.accum_modes`: how far each `AccumOptimizer` mode
  (buffer, momentum, rescale) ends from the inner optimizer at batch k*b, for
  six optimizers on scikit-learn's digits (`docs/rescale.md`).
- `python -m benchmarks.accum_batchnorm`: the distance of
  `accum.BatchNormalization`'s moving statistics from a plain layer at batch
  k*b, per mode, under mixed precision and `MirroredStrategy`, in both Keras
  families (`docs/accumulation.md`).

Shared modules (not tools): `harness` (fresh worker processes, peak RSS,
allocator statistics, free ports, argument types, least squares, progress
lines), `encoder` (the transformer encoder of the two `recompute_*`
benchmarks and its shape options) and `allreduce` (`AllReduceCounter`, which
the tests use too) and `held` (TensorFlow's allocation log read back: what a step
holds at its peak, for `recompute_memory --held`).
"""
