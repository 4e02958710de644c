"""Fine-tune a keras-hub causal language model with LoRA, recomputation and gradient
accumulation, on Keras 3's TensorFlow or JAX backend -- nothing to download.

    python examples/keras_hub_lm_finetune.py                      # TensorFlow, < 2 min on 2 CPU cores
    python examples/keras_hub_lm_finetune.py --backend jax --model llama --seq 128 --updates 60

The model is a randomly initialized Gemma-shaped (or `--model llama`) `CausalLM` of
`--layers`, `--hidden`, `--heads` (FFN 4x hidden), dropout 0.1; `backbone.enable_lora(rank)`
freezes it and adds LoRA factors to every query and value projection: only those train. The
task is generated: each sequence is `BOS a1 .. an SEP a1 .. an` (n = (seq - 2) / 2 random
tokens), and the loss counts the copied half only, so the loss falls from about
ln(vocab) as the LoRA factors learn to copy.

1. `recompute.keras_hub.patch()` makes every decoder block keep only its inputs and
   recompute its activations in the backward pass whenever RECOMPUTE is on (gradients
   unchanged). The example measures one forward and backward pass with RECOMPUTE off and
   on: its memory (TensorFlow: the CPU allocator's peak; JAX: XLA's compiled temporary
   buffers, `memory_analysis()`) and its time.
2. `AccumOptimizer(Adam, --accum-steps k)`: micro-batches of `--batch-size b` update like a
   batch of k*b. `fit` trains `--updates` weight updates with RECOMPUTE on, printing the
   loss as it goes down.
3. `recompute.keras_hub.chunked_loss(lm)` (after `compile`; `--full-logits` leaves it out):
   `fit` computes the head's logits and the loss a chunk of tokens at a time, never the
   micro-batch's [tokens, vocabulary] logits (same loss and gradients). The example prints
   the float32 size of one such tensor against one chunk's (computed from the shapes, not
   measured; the full-logit step holds several: the logits, their softmax, its gradient).

`fit` runs in up to five rounds of whole updates (`--updates 12` in rounds of 3, 3, 2, 2, 2);
each progress line shows the optimizer's own count of weight updates. The exit status is 0
only when exactly `--updates` updates were applied and the frozen weights are unchanged.

Limits: a random model on a toy task (the point is the mechanics, memory and time, not the
model). To resume a LoRA fine-tune
exactly, save `.weights.h5` and `backbone.save_lora_weights(...)` (Keras merges the factors
into the kernels when it saves a LoRA layer; see tests/helpers/keras_hub_lora_checks.py).
"""

import argparse
import math
import os
import sys
import time

BACKENDS = ("tensorflow", "jax")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default=os.environ.get("KERAS_BACKEND", "tensorflow"),
                   help="Keras 3 backend (default: KERAS_BACKEND, else tensorflow)")
    p.add_argument("--model", choices=("gemma", "llama"), default="gemma")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch (default 8)")
    p.add_argument("--accum-steps", type=int, default=2, help="micro-batches per update (default 2)")
    p.add_argument("--updates", type=int, default=40, help="weight updates (default 40)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--policy", choices=("full", "attention"), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-logits", action="store_true",
                   help="train with keras-hub's full logits instead of `chunked_loss`")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="tokens per chunk of the chunked loss (default: chunked_loss's)")
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "heads", "batch_size", "accum_steps", "updates", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.hidden % args.heads:
        p.error(f"--hidden must be a multiple of --heads. Received: {args.hidden} and {args.heads}")
    if args.rank > args.hidden // args.heads:
        p.error(f"--rank must be <= the head size --hidden / --heads = {args.hidden // args.heads} "
                "(LoRA factors each projection per head; a higher rank adds weights, not rank). "
                f"Received: {args.rank}")
    if args.seq < 4 or args.seq % 2:
        p.error(f"--seq must be an even number >= 4. Received: {args.seq}")
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        p.error(f"--chunk-tokens must be >= 1. Received: {args.chunk_tokens}")
    if args.vocab < 4:
        p.error(f"--vocab must be >= 4. Received: {args.vocab}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a finite number > 0. Received: {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be an integer >= 0. Received: {args.seed}")
    return args


def copy_task(n, seq, vocab, seed):
    """(x, y, sample_weight) of `n` sequences BOS a SEP a: next-token targets, weighted on the copy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    half = (seq - 2) // 2
    a = rng.integers(3, vocab, size=(n, half))
    ids = np.concatenate([np.full((n, 1), 1), a, np.full((n, 1), 2), a, np.zeros((n, 1), int)], 1)
    ids = ids[:, :seq + 1].astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, seq), bool)}
    weight = np.zeros((n, seq), "float32")
    weight[:, half + 1:2 * half + 1] = 1.0  # predicting the copied tokens
    return x, ids[:, 1:], weight


def rounds(updates, n):
    """`n` whole numbers of updates, as equal as can be, that add up to `updates`."""
    return [updates // n + (i < updates % n) for i in range(n)]


def build(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(args.seed)
    head_dim = args.hidden // args.heads
    if args.model == "gemma":
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=args.heads,
            num_key_value_heads=args.heads, hidden_dim=args.hidden,
            intermediate_dim=8 * args.hidden, head_dim=head_dim, dropout=0.1)  # Gemma halves it
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=args.heads,
            num_key_value_heads=args.heads, hidden_dim=args.hidden,
            intermediate_dim=4 * args.hidden, dropout=0.1)
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(args.rank)
    return lm


def _loss(keras, logits, y, weight):
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return keras.ops.sum(loss * weight) / keras.ops.sum(weight)


def measure(lm, batch, on, repeats=3):
    """(MiB, seconds) of one forward and backward pass over the LoRA weights, RECOMPUTE `on`:
    TensorFlow's CPU allocator peak above what was alive / XLA's temporary buffers (JAX)."""
    import keras

    from recompute import recompute_scope

    x, y, weight = batch
    with recompute_scope(on):
        if keras.backend.backend() == "jax":
            import jax

            def loss_fn(trainable, non_trainable):
                logits, _ = lm.stateless_call(trainable, non_trainable, x, training=True)
                return _loss(keras, logits, y, weight)

            values = ([v.value for v in lm.trainable_variables],
                      [v.value for v in lm.non_trainable_variables])
            compiled = jax.jit(jax.grad(loss_fn)).lower(*values).compile()
            mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
            jax.block_until_ready(compiled(*values))
            t0 = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(compiled(*values))
            return mib, (time.perf_counter() - t0) / repeats
        import tensorflow as tf

        @tf.function
        def grads():
            with tf.GradientTape() as tape:
                loss = _loss(keras, lm(x, training=True), y, weight)
            return tape.gradient(loss, lm.trainable_variables)

        grads()  # traced with RECOMPUTE as set here
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        t0 = time.perf_counter()
        for _ in range(repeats):
            grads()
        seconds = (time.perf_counter() - t0) / repeats
        return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2**20, seconds


def run(args):
    """Builds, measures and trains as `args` says; returns a dict of what it printed."""
    import keras
    import numpy as np

    import recompute
    import recompute.keras_hub
    from accum import AccumOptimizer
    from recompute import recompute_scope

    recompute.keras_hub.patch(policy=args.policy)
    lm = build(args)
    blocks = recompute.keras_hub.covered(lm)
    lora = lm.trainable_variables
    frozen = [(v, np.array(v.numpy())) for v in lm.non_trainable_weights]
    print(f"{args.model}-shaped causal LM on Keras 3 / {keras.backend.backend()}: {args.layers} blocks "
          f"recomputed ({len(blocks)} covered), hidden {args.hidden}, seq {args.seq}; LoRA rank "
          f"{args.rank}: {sum(int(np.prod(v.shape)) for v in lora):,} trainable of "
          f"{lm.count_params():,} weights; micro-batch {args.batch_size} x {args.accum_steps} = "
          f"effective batch {args.batch_size * args.accum_steps}", flush=True)

    measured = {}
    batch = copy_task(args.batch_size, args.seq, args.vocab, args.seed + 1)
    unit = "CPU allocator peak" if keras.backend.backend() == "tensorflow" else "XLA temp buffers"
    for on in (False, True):
        measured[on] = measure(lm, batch, on)
        print(f"  one forward+backward, RECOMPUTE={int(on)}: {measured[on][0]:8.2f} MiB ({unit}), "
              f"{measured[on][1] * 1e3:7.1f} ms", flush=True)
    (mib0, s0), (mib1, s1) = measured[False], measured[True]
    print(f"  recomputation: {mib0 / max(mib1, 1e-9):.1f}x less memory, {s1 / s0:.2f}x the time")

    x, y, weight = copy_task(args.updates * args.accum_steps * args.batch_size, args.seq,
                             args.vocab, args.seed + 2)
    lm.compile(AccumOptimizer(keras.optimizers.Adam(args.lr), args.accum_steps),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])
    if not args.full_logits:
        recompute.keras_hub.chunked_loss(lm, chunk_tokens=args.chunk_tokens)  # after compile
        chunk = recompute.keras_hub.is_chunked(lm)
        tokens = args.batch_size * args.seq
        full_mib, chunk_mib = tokens * args.vocab * 4 / 2**20, min(chunk, tokens) * args.vocab * 4 / 2**20
        print(f"chunked loss: the head's logits {min(chunk, tokens)} tokens at a time: "
              f"{chunk_mib:.3f} MiB per chunk instead of {full_mib:.3f} MiB for the micro-batch's "
              f"[{tokens}, {args.vocab}] float32 logits; {full_mib - chunk_mib:.3f} MiB saved per "
              "such tensor (computed from the shapes)", flush=True)
    else:
        print("full logits: keras-hub's own head and loss (--full-logits)", flush=True)
    print(f"training with RECOMPUTE=1 (policy {args.policy!r}), AccumOptimizer(Adam({args.lr:g}), "
          f"{args.accum_steps}); loss = cross-entropy on the copied half (ln {args.vocab} = "
          f"{np.log(args.vocab):.2f} at chance)", flush=True)
    losses = []
    t0 = time.perf_counter()
    with recompute_scope(True):
        offset = 0
        for size in rounds(args.updates, min(5, args.updates)):
            part = slice(offset, offset + size * args.accum_steps * args.batch_size)
            offset = part.stop
            history = lm.fit({name: v[part] for name, v in x.items()}, y[part],
                             sample_weight=weight[part], batch_size=args.batch_size, epochs=1,
                             shuffle=False, verbose=0)
            losses.append(float(history.history["loss"][-1]))
            print(f"  updates {int(lm.optimizer.iterations.numpy()):4d}/{args.updates}: "  # counted
                  f"loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - t0
    unchanged = all(np.array_equal(v.numpy(), start) for v, start in frozen)
    updates = int(lm.optimizer.iterations.numpy())
    print(f"trained in {seconds:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}; frozen weights "
          f"unchanged: {unchanged}; weight updates: {updates} of {args.updates}")
    return {"losses": losses, "mib": [mib0, mib1], "seconds": [s0, s1], "unchanged": unchanged,
            "updates": updates}


def main(argv=None):
    args = parse_args(argv)
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != args.backend:
        raise SystemExit(f"--backend {args.backend}: Keras is already imported on another backend")
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # TensorFlow's CPU allocator statistics
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout
    result = run(args)
    return 0 if result["unchanged"] and result["updates"] == args.updates else 1


if __name__ == "__main__":
    sys.exit(main())
