"""What several test suites share.

- `numerics`: comparisons of gradients, weights and state, with the tolerances.
- `k3_reference`, `tfk_reference`: models, data and big-batch reference runs for
  the `AccumOptimizer` suites (Keras 3, tf_keras).
- `recompute_distributed`: the block model and loops of the recompute distribution tests.
- `mwms`: runs 2 `MultiWorkerMirroredStrategy` worker processes on loopback;
  `mwms_worker` (AccumOptimizer) and `mwms_recompute_worker` (recompute_grad)
  are those workers (`python -m tests.helpers.<worker>`).
- `save_resume_worker`: saves in one process, loads and resumes in a fresh one.
- `numpy_bert`: an independent NumPy BERT, the converter's reference.
- `k3_optimizers`: the Keras 3 inner optimizers of the exactness suites (TensorFlow, JAX).
- `accum_family_checks`: AccumOptimizer checks written once for every family; each
  suite's `test_family_checks*.py` imports them with its fixture `family`.
- `jax_backend`: selects Keras's JAX backend for the JAX suites (their conftest.py).
"""
