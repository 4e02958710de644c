"""One `MultiWorkerMirroredStrategy` worker for the recompute_grad multi-process tests
(started by `mwms.py`).

    TF_CONFIG=... python -m tests.helpers.mwms_recompute_worker keras3|tf_keras OUT_DIR

Trains the block model of `recompute_distributed.py` (dropout on, BatchNormalization)
for 2 steps of SGD in a custom loop, global batch 8 (each worker feeds its own 4
rows), once with recomputation off and once on (`recompute_scope`, which reaches the
strategy's replica thread), and writes to `OUT_DIR/worker<task>.npz`: the last
step's gradients of the inputs and of every weight (this worker's, before the
all-reduce), the state (weights, moving statistics, RNG states), the trainable
weights and the number of block calls traced, for each setting.
"""

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.helpers.recompute_distributed import block_model, data, run_custom_loop  # noqa: E402

B, STEPS = 8, 2


def main():
    family, out_dir = sys.argv[1], sys.argv[2]
    config = json.loads(os.environ["TF_CONFIG"])
    task, workers = config["task"]["index"], len(config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if family == "keras3":
        import keras

        make_model = functools.partial(block_model, keras)
        make_optimizer = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    else:
        import tf_keras

        make_model = functools.partial(block_model, tf_keras)
        tf_keras.backend.experimental.enable_tf_random_generator()
        make_optimizer = lambda: tf_keras.optimizers.SGD(0.1)  # noqa: E731
    x, y = data(STEPS * B)
    rows = B // workers
    mine = [slice(s + task * rows, s + (task + 1) * rows) for s in range(0, STEPS * B, B)]
    batches = [(tf.constant(x[r]), tf.constant(y[r])) for r in mine]
    out = {}
    for on, tag in ((False, "off"), (True, "on")):
        grads, state, calls = run_custom_loop(strategy, make_model, make_optimizer, batches, B, on)
        out.update({f"grads_{tag}_{i}": g for i, g in enumerate(grads)})
        out.update({f"state_{tag}_{i}": s for i, s in enumerate(state)})
        out[f"calls_{tag}"] = calls
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), **out)
    sys.stdout.flush()
    # TensorFlow's collective runtime can crash while the interpreter shuts down;
    # the results are written, so leave without running the teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
