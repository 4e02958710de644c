"""`chunked_loss(causal_lm)`: a keras-hub causal LM trained and evaluated without its
[tokens, vocabulary] logits.

The model is changed in place, by instance attributes (as `accum.local_gradients`
does), on Keras's TensorFlow and JAX backends:

- `train_step` and `test_step` run the model's own step (Keras's, or one already set
  on the instance) with the chunked head on: while it is traced, `call` returns
  `{"hidden": the backbone's hidden states}` instead of the logits;
- `compute_loss` computes keras-hub's loss from them with `_head.chunked` (the head's
  logits chunk by chunk, their log-sum-exp and the target's logit; in training the
  head's gradients too), then adds the layers' own losses as Keras does; it puts the
  per-token hits (arg-max == target) into the same dict;
- `compute_metrics` updates the compiled accuracy metrics from those hits (Keras's
  own metric objects, fed two-class "logits" whose arg-max is 0 exactly where the
  head's arg-max is the target: the same counts and weights);
- `compile` drops all of this (keras-hub's own step again) and compiles.

`predict`, `generate` and calls of the model outside `fit`/`evaluate`/
`train_on_batch`/`test_on_batch` run as keras-hub wrote them: the full logits.
"""

import types

from . import _head, _private
from .._scoped import ThreadStack

_REPLACED = ("call", "compute_loss", "compute_metrics", "train_step", "test_step", "compile")
_STATE = "_recompute_chunked_head"
_ACCURACY_NAMES = ("accuracy", "acc", "sparse_categorical_accuracy")
_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")
_active = ThreadStack()  # ids of the models whose chunked step runs, this thread


def chunked_loss(causal_lm, chunk_tokens=None):
    """Trains and evaluates a compiled keras-hub `CausalLM` with its head and loss in chunks.

    `fit`, `train_on_batch`, `evaluate` and `test_on_batch` then compute the
    language-model head (the token embedding reversed, with the model's final-logit
    soft cap if it has one) and keras-hub's loss, `SparseCategoricalCrossentropy(
    from_logits=True)`, `chunk_tokens` tokens at a time, keeping per token only the
    loss and whether the arg-max is the target: never the [tokens, vocabulary]
    logits, their softmax or their gradient (2 GiB each in float32 for one sequence
    of 2048 tokens of Gemma's 256,000 words). The head's gradients are formed in the
    forward pass, chunk by chunk, so the step multiplies no more than keras-hub's.
    The loss, every gradient and the weighted accuracy metric equal keras-hub's own
    to float rounding, with padding masks and `sample_weight`:

    ```python
    causal_lm = keras_hub.models.GemmaCausalLM.from_preset(path)
    causal_lm.backbone.enable_lora(8)
    causal_lm.compile(optimizer=AccumOptimizer(keras.optimizers.AdamW(1e-4), 8))
    recompute.keras_hub.chunked_loss(causal_lm)      # after compile
    causal_lm.fit(dataset)
    ```

    Args:
        causal_lm: a compiled keras-hub `CausalLM` whose head is its backbone's
            `ReversibleEmbedding` reversed (Gemma, Gemma 2, Llama, Mistral, GPT-2,
            ...), compiled with keras-hub's loss (`loss="auto"`, or
            `SparseCategoricalCrossentropy(from_logits=True)` with a reduction other
            than `None`) and accuracy metrics only (`"auto"`,
            `SparseCategoricalAccuracy`, `"accuracy"`), or none.
        chunk_tokens: the tokens of one chunk; `None` (the default) for chunks of
            logits of at most 2**27 entries (512 MiB in float32): 520 tokens at
            256,000 words, 2664 at GPT-2's 50,257.

    Returns:
        `causal_lm`, changed in place. `predict` and `generate` still compute the
        full logits. Compiling the model again drops the chunked loss (keras-hub's
        own step again, whatever the new loss): call `chunked_loss` after each
        `compile`. Calling it again changes `chunk_tokens`.
    """
    if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(
            f"`chunk_tokens` must be an integer >= 1 or None. Received: chunk_tokens={chunk_tokens!r}")
    embedding = _head_of(causal_lm)
    _check_compiled(causal_lm)
    _restore(causal_lm)
    chunk = chunk_tokens or _head.default_chunk_tokens(embedding.input_dim)
    object.__setattr__(causal_lm, _STATE, {"chunk_tokens": chunk, "embedding": embedding,
                                           "previous": _previous_steps(causal_lm)})
    for name, fn in (("call", _call), ("compute_loss", _compute_loss),
                     ("compute_metrics", _compute_metrics), ("train_step", _train_step),
                     ("test_step", _test_step), ("compile", _compile)):
        object.__setattr__(causal_lm, name, types.MethodType(fn, causal_lm))
    causal_lm.train_function = None
    causal_lm.test_function = None
    return causal_lm


def is_chunked(causal_lm):
    """The chunk size in tokens if `chunked_loss` is on for `causal_lm`, else None."""
    state = vars(causal_lm).get(_STATE)
    return state["chunk_tokens"] if state else None


# ------------------------------------------------------------------ checks

def _head_of(model):
    """The `ReversibleEmbedding` whose reverse call makes `model`'s output, or a clear error."""
    import keras_hub

    if not isinstance(model, keras_hub.models.CausalLM):
        raise TypeError(
            "`chunked_loss` needs a keras-hub `CausalLM` (e.g. `keras_hub.models."
            f"GemmaCausalLM`). Received: causal_lm={model!r} of type {type(model).__name__}")
    name = type(model).__name__
    backbone = getattr(model, "backbone", None)
    embedding = getattr(backbone, "token_embedding", None)
    if not _is_reversible_embedding(embedding):
        raise ValueError(
            f"`chunked_loss` chunks a head that is the backbone's `ReversibleEmbedding` "
            f"reversed; {name}'s backbone has no such `token_embedding`. Received: "
            f"token_embedding={embedding!r}")
    why = _head_graph_mismatch(model, backbone, embedding)
    if why:
        raise ValueError(
            f"`chunked_loss` cannot chunk {name}'s head: its logits must be "
            f"`backbone.token_embedding(backbone(inputs), reverse=True)`, as keras-hub's "
            f"Gemma, Llama, GPT-2, ... causal LMs make them. Received: {why}")
    mode = getattr(embedding, "quantization_mode", None)
    if mode is not None:
        raise ValueError(
            "`chunked_loss` cannot chunk a quantized token embedding. Received: "
            f"quantization_mode={mode!r}")
    return embedding


def _reversible_embedding_calls():
    """The `call`s of the `ReversibleEmbedding` classes (Keras's, keras-hub's): those whose
    reverse call `_head` computes."""
    import keras

    calls = []
    if hasattr(keras.layers, "ReversibleEmbedding"):
        calls.append(keras.layers.ReversibleEmbedding.call)
    try:
        from keras_hub.src.layers.modeling.reversible_embedding import ReversibleEmbedding
    except ImportError:  # pragma: no cover (older or newer keras-hub)
        pass
    else:
        calls.append(ReversibleEmbedding.call)
    return calls


def _is_reversible_embedding(layer):
    return layer is not None and getattr(type(layer), "call", None) in _reversible_embedding_calls()


def _head_graph_mismatch(model, backbone, embedding):
    """Why `model`'s functional graph is not backbone -> embedding(reverse=True), or None."""
    if type(model).call is not _functional_call():
        return f"{type(model).__name__} overrides `call`"
    outputs = getattr(model, "outputs", None) or []
    if len(outputs) != 1:
        return f"{len(outputs)} outputs"
    layer, node = _private.made_by(outputs[0])
    if layer is not embedding or not node.arguments.kwargs.get("reverse", False):
        return f"the output is made by {getattr(layer, 'name', layer)!r}"
    args = node.arguments.args
    hidden = args[0] if args else node.arguments.kwargs.get("inputs")
    if hidden is None or _private.made_by(hidden)[0] is not backbone:
        return "the reversed embedding is not called on the backbone's output"
    return None


def _functional_call():
    return _private.functional_call()


def _check_compiled(model):
    import keras

    if not getattr(model, "compiled", False):
        raise ValueError(
            "`chunked_loss` needs a compiled `CausalLM`: call `causal_lm.compile(...)` "
            "first, then `chunked_loss(causal_lm)` (compiling again drops it). "
            f"Received: an uncompiled {type(model).__name__}")
    arguments = _private.compile_arguments(model)
    loss = arguments.get("loss")
    config = loss.get_config() if isinstance(loss, keras.losses.SparseCategoricalCrossentropy) else None
    if (config is None or not config.get("from_logits") or config.get("ignore_class") is not None
            or getattr(loss, "reduction", None) not in _REDUCTIONS):
        raise ValueError(
            "`chunked_loss` computes keras-hub's loss, `keras.losses.SparseCategorical"
            "Crossentropy(from_logits=True)` (without `ignore_class`, with a reduction of "
            f"{', '.join(map(repr, _REDUCTIONS))}); compile with `loss=\"auto\"` or that loss. "
            f"Received: loss={loss!r}" + (f" with {config}" if config else ""))
    if arguments.get("loss_weights") is not None:
        raise ValueError(
            "`chunked_loss` does not weight its loss: compile without `loss_weights`. "
            f"Received: loss_weights={arguments['loss_weights']!r}")
    for key in ("metrics", "weighted_metrics"):
        for metric in _flat(arguments.get(key)):
            if not _is_accuracy(metric):
                raise ValueError(
                    "`chunked_loss` computes the accuracy metric chunk by chunk (keras-hub's "
                    "default `SparseCategoricalAccuracy`, or `\"accuracy\"`); other metrics "
                    "would need the full logits. Compile without them (or evaluate them "
                    f"with `predict`). Received: {key} containing {metric!r}")


def _flat(metrics):
    if metrics is None:
        return []
    if isinstance(metrics, dict):
        return [m for v in metrics.values() for m in _flat(v)]
    if isinstance(metrics, (list, tuple)):
        return [m for v in metrics for m in _flat(v)]
    return [metrics]


def _is_accuracy(metric):
    import keras

    if isinstance(metric, str):
        return metric in _ACCURACY_NAMES
    return isinstance(metric, keras.metrics.SparseCategoricalAccuracy)


# ----------------------------------------------------------- install, undo

def _previous_steps(model):
    """The instance's own `train_step`/`test_step` (another wrapper's), to run inside ours."""
    return {name: vars(model)[name] for name in ("train_step", "test_step") if name in vars(model)}


def _restore(model):
    """Removes `chunked_loss`'s instance attributes (a wrapped step set on the instance
    before it comes back)."""
    state = vars(model).get(_STATE)
    if state is None:
        return
    for name in _REPLACED:
        if name in vars(model):
            object.__delattr__(model, name)
    for name, step in state["previous"].items():
        object.__setattr__(model, name, step)
    object.__delattr__(model, _STATE)
    model.train_function = None
    model.test_function = None


def _compile(self, *args, **kwargs):
    """`compile`, after giving the model keras-hub's own (full-logit) step back."""
    _restore(self)
    return self.compile(*args, **kwargs)


def _on(model):
    return _active.entered(id(model))


def _is_on(model):
    return _active.top() == id(model)


def _step(model, name):
    previous = vars(model)[_STATE]["previous"].get(name)
    return previous if previous is not None else getattr(type(model), name).__get__(model)


# ------------------------------------------------------------ the methods

def _train_step(self, *args, **kwargs):
    with _on(self):
        return _step(self, "train_step")(*args, **kwargs)


def _test_step(self, *args, **kwargs):
    with _on(self):
        return _step(self, "test_step")(*args, **kwargs)


def _call(self, inputs, *args, **kwargs):
    """The backbone's hidden states (in a dict) inside our steps; keras-hub's logits elsewhere."""
    if not _is_on(self):
        return type(self).call(self, inputs, *args, **kwargs)
    training = kwargs.get("training", args[0] if args else None)
    return {"hidden": self.backbone(inputs, training=training)}


def _is_hidden(y_pred):
    return isinstance(y_pred, dict) and "hidden" in y_pred


def _compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    if not _is_hidden(y_pred):
        return type(self).compute_loss(self, x, y, y_pred, sample_weight, training=training)
    from keras import ops

    state = vars(self)[_STATE]
    embedding = state["embedding"]
    kernel, vocab_major, kernel_grad = _kernel(embedding)
    hidden = y_pred["hidden"]
    h = ops.cast(ops.reshape(hidden, (-1, hidden.shape[-1])), kernel.dtype)
    targets = ops.reshape(ops.cast(y, "int32"), (-1,))
    loss = self.loss
    weights = _token_weights(y, sample_weight, loss.reduction)
    loss_sum, hits = _head.chunked(
        h, kernel, targets, ops.reshape(weights, (-1,)), chunk=state["chunk_tokens"],
        cap=embedding.logit_soft_cap, vocab_major=vocab_major, grads=bool(training),
        kernel_grad=kernel_grad)
    y_pred["hits"] = ops.reshape(hits, ops.shape(y))
    losses = [ops.cast(loss_sum, "float32")]
    losses += [_private.additional_loss(self, extra) for extra in self.losses]
    return losses[0] if len(losses) == 1 else ops.sum(losses)


def _kernel(embedding):
    """`(kernel, vocab_major, trains)`: the head's kernel as its reverse call reads it
    (in the compute or `reverse_dtype`), whether it is [vocabulary, hidden] (tied), and
    whether it has a gradient (its variable, or LoRA factors of it, trainable)."""
    from keras import ops

    dtype = embedding.reverse_dtype or embedding.compute_dtype
    if embedding.tie_weights:
        kernel = embedding.embeddings  # with LoRA factors merged where enabled
        untied = getattr(embedding, "reverse_embeddings", None)
        trains = embedding.trainable and any(
            v.trainable for v in embedding.trainable_weights if v is not untied)
        return ops.cast(kernel, dtype), True, trains
    kernel = embedding.reverse_embeddings
    trains = embedding.trainable and kernel.trainable
    return ops.cast(kernel, dtype), False, trains


def _token_weights(y, sample_weight, reduction):
    """Each token's weight in the loss `sum(weights * per-token loss)` that Keras's
    `reduce_weighted_values` makes of the per-token losses, with no Keras mask."""
    import keras
    from keras import ops

    shape = ops.shape(y)
    if sample_weight is None:
        weights = ops.ones(shape, "float32")
    else:
        weights = ops.cast(sample_weight, "float32")
        if len(weights.shape) == 3 and weights.shape[-1] == 1:
            weights = ops.squeeze(weights, -1)
        if len(weights.shape) == 1:
            weights = weights[:, None]
        weights = ops.broadcast_to(weights, shape)
    if reduction == "sum":
        return weights
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        divisor = ops.sum(weights)
    else:
        divisor = ops.cast(ops.prod(ops.convert_to_tensor(shape, "int32")), "float32")
    weights = ops.divide_no_nan(weights, divisor)
    if keras.backend.backend() == "tensorflow":  # Keras's scale_loss_for_distribution
        import tensorflow as tf

        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            weights = weights * (1.0 / replicas)
    return weights


def _compute_metrics(self, x, y, y_pred, sample_weight=None):
    if not _is_hidden(y_pred):
        return type(self).compute_metrics(self, x, y, y_pred, sample_weight)
    from keras import ops

    metrics = _private.compile_metrics(self)
    if metrics is not None:
        hits = y_pred["hits"]
        # Two-class "logits" whose arg-max is class 0 exactly where the head's is the target.
        pseudo = ops.stack([hits, 1.0 - hits], axis=-1)
        metrics.update_state(ops.zeros_like(ops.cast(y, "int32")), pseudo, sample_weight)
    return self.get_metrics_result()
