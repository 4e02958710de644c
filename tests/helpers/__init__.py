"""What several test suites share.

- `numerics`: comparisons of gradients, weights and state, with the tolerances.
- `k3_reference`, `tfk_reference`: models, data and big-batch reference runs for
  the `AccumOptimizer` suites (Keras 3, tf_keras); `accum_runs`, the family-free part
  they both import, and runs those suites share around tests that differ.
- `recompute_distributed`: the block model and loops of the recompute distribution tests.
- `families`: the fixture `K` (`keras3` or `tf_keras`) of the recompute tests written
  once for both families: `recompute_edge_checks`, `recompute_inner_tape_checks`,
  `recompute_distribute_checks`, `attention_blocks` (policies), `step_ordering`; each
  suite's thin test module star-imports their `test_*` functions (`__all__`) with its
  fixture. `recompute_runs`: runs and checks those suites share around tests that differ.
- `keras_hub_checks`: the keras-hub tests of the TensorFlow and JAX suites, imported the same way;
  `keras_hub_decoder_checks`: every block class `recompute.keras_hub.patch()` covers, likewise.
  `keras_hub_lora_checks`: LoRA + `patch()` + `AccumOptimizer` on a causal LM (gradients,
  accumulation, save and resume in a fresh process), likewise.
- `protocol_checks`: whether a module implements a `Protocol` interface (recompute's
  adapters, accum's inner-optimizer APIs).
- `commands`: `run_module`, a module of this repository run as a command (`python -m`).
- `layout`: a library package's import graph from its source (the layout tests of accum
  and recompute).
- `mwms`: runs 2 `MultiWorkerMirroredStrategy` worker processes on loopback;
  `mwms_worker` (AccumOptimizer) and `mwms_recompute_worker` (recompute_grad)
  are those workers (`python -m tests.helpers.<worker>`).
- `save_resume_worker`: saves in one process, loads and resumes in a fresh one.
- `numpy_bert`: an independent NumPy BERT, the converter's reference.
- `k3_optimizers`: the Keras 3 inner optimizers of the exactness suites (TensorFlow, JAX).
- `accum_family_checks`: AccumOptimizer checks written once for every family; each
  suite's `test_family_checks*.py` imports them with its fixture `family`, also the
  fixture (with `legacy` and `floatx`) of `accum_distribute_checks`,
  `accum_missing_gradients_checks` and `accum_batchnorm_checks`, whose `test_*`
  functions (`__all__`) the Keras 3 and tf_keras suites star-import the same way.
  `save_resume_checks`: the save/resume plan's fixture and check of the three suites.
- `jax_backend`: selects Keras's JAX backend for the JAX suites (their conftest.py).
- `jax_distribution_worker`: `keras.distribution` runs on 4 virtual CPU devices, in a process
  of its own (tests/accum_jax/test_distribution_jax.py), `accum.local_gradients` included;
  `jax_multiprocess_worker`: one of 2 JAX processes on localhost (`jax.distributed`);
  `hlo`: the all-reduces of a compiled JAX step, read from its HLO text.
"""
