"""`patch()` / `unpatch()`: bert4keras's layers marked for recomputation use `recompute_grad` (see the package docstring)."""

import functools
import importlib.abc
import inspect
import os
import sys
import threading
import warnings

from ..adapters import _backends
from .. import _config
from .. import engine
from ..ops import _lean
from ..policies import _blocks, _registry
from . import _attention, _feed_forward, _norm_from_output
from ..engine import after
from .._decorator import recompute_grad
from .._scoped import ThreadStack

MODULE = "bert4keras.layers"
MODELS_MODULE = "bert4keras.models"

_replaced = {}  # (class, method name) -> the method it had before `patch()`
_module_dropout = {}  # module -> the `Dropout` it had before `patch()`
_module_gelu = {}  # module -> the "gelu" of Keras's custom objects before `patch()`
_hook = None
_attending = ThreadStack()  # the layers inside `pay_attention_to`, this thread
ATTENTION_DROPOUT_ATTR = "recompute_attention_dropout"


def _undecorated(fn):
    """The function bert4keras's `recompute_grad` wrapped, or `fn` if it returned it as is."""
    code = getattr(fn, "__code__", None)
    if code is not None and fn.__closure__ and "call" in code.co_freevars:
        if fn.__module__ == "bert4keras.backend":
            return fn.__closure__[code.co_freevars.index("call")].cell_contents
    return fn


def _is_marked(fn):
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return source.lstrip().startswith("@recompute_grad")


def marked_classes(module):
    """The classes of `module` whose `call` bert4keras decorates with `@recompute_grad`."""
    found = []
    for obj in vars(module).values():
        if isinstance(obj, type) and obj.__module__ == module.__name__ and "call" in obj.__dict__:
            if _is_marked(_undecorated(obj.__dict__["call"])):
                found.append(obj)
    return found


def _attention_classes(module):
    return [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
        and "pay_attention_to" in obj.__dict__
    ]


def _owned_dropout(dropout_cls):
    """bert4keras's `Dropout(rate)` inside `pay_attention_to`, made one sublayer per layer.

    bert4keras creates a new `Dropout` layer on every attention call. With
    tf_keras's replayable RNG (`enable_tf_random_generator()`) each new layer
    would create a new random-generator variable per call -- `fit` then fails
    ("tf.function only supports singleton tf.Variables") and no seed could be
    replayed. Inside `pay_attention_to`, the first `Dropout(rate)` of a layer
    is kept as its sublayer `recompute_attention_dropout` and reused by every
    later call; everywhere else `Dropout` is tf_keras's own, whose call keeps its
    decision as bits under "attention" (`_hidden_dropout`).
    """

    def Dropout(rate, *args, **kwargs):
        owner = _attending.top()
        if owner is None or args or kwargs:
            return _hidden_dropout(dropout_cls(rate, *args, **kwargs))
        cached = getattr(owner, ATTENTION_DROPOUT_ATTR, None)
        if cached is None or cached.rate != rate:
            cached = dropout_cls(rate, name=f"{owner.name}-{ATTENTION_DROPOUT_ATTR}")
            setattr(owner, ATTENTION_DROPOUT_ATTR, cached)  # tracked as a sublayer
        return cached

    Dropout.__wrapped__ = dropout_cls
    return Dropout


def _hidden_dropout(layer):
    """`layer`, a `Dropout` of bert4keras's model (its embeddings' and blocks' dropouts,
    outside every marked class), whose call keeps its decision as bits (1 per entry,
    where autodiff keeps bools, 8) while it runs under the "attention" policy with
    recomputation on and patched (`_lean.keeping_bits`: the layer's own random numbers,
    TensorFlow's dropout and its gradient op for op); as written otherwise, and for a
    `Dropout` that is not plain (`_lean.plain_dropout`: a noise shape, a rate of 0)."""
    if not _lean.plain_dropout(layer):
        return layer
    own, keeping = layer.call, _lean.dropout_call(layer, layer.call)

    @functools.wraps(own)
    def call(inputs, training=None, **kwargs):
        if _policy_of(layer) == "attention" and is_patched() and _config.is_enabled():
            return keeping(inputs, training=training, **kwargs)
        return own(inputs, training=training, **kwargs)

    object.__setattr__(layer, "call", call)  # this instance only; not tracked
    return layer


POLICIES = ("layer", "block", "attention", "block_keep_ffn")
BLOCK_POLICIES = ("block", "block_keep_ffn")  # each Transformer block one recomputed unit
_policy = "layer"  # the policy of `patch()`, taken by each patched layer at its first call
_POLICY_ATTR = "_recompute_bert4keras_policy"


def _policy_of(layer):
    """The policy `layer` was built under (the current one at its first call)."""
    policy = layer.__dict__.get(_POLICY_ATTR)
    if policy is None:
        policy = _policy
        object.__setattr__(layer, _POLICY_ATTR, policy)  # a plain attribute, not tracked
    return policy


# Under "attention", the element-wise marked layers are recomputed as units too
# (they keep only their input): their intermediates cost memory, their
# recomputation little time.
ELEMENTWISE = ("LayerNormalization", "ScaleOffset")
_selective = threading.local()  # .depth > 0: inside a FeedForward under "attention", RECOMPUTE on


def _marked_call(call, cls):
    """A marked class's `call`: recomputed as a unit under the "layer" and "block"
    policies (within a recomputed block it runs plainly; a standard `FeedForward` in its
    recomputation as `_feed_forward.lean_call`, its GELU keeping only its input). Under
    "attention", the
    element-wise classes (`ELEMENTWISE`) are still units; the others run as
    written, except a `FeedForward`, whose GELU keeps only its input
    (`_feed_forward`). Under "block_keep_ffn" a `FeedForward` inside its
    recomputed block keeps its second product for the recomputation
    (`_feed_forward.lean_call(..., keep_product=True)`); under "block" the block's last
    LayerNorm takes its gradient from the block's output in the recomputation, which then
    skips that product (`_norm_from_output`). Under "attention" a
    LayerNormalization unit's output is marked as made again from its kept input
    (`_feed_forward.remade_from_input`), for a `FeedForward` or the `Dense` layers of an
    attention layer it feeds (`_feed_forward.dense_inputs_remade`)."""
    elementwise = cls.__name__ in ELEMENTWISE
    norm = cls.__name__ == "LayerNormalization"
    feed_forward = cls.__name__ == "FeedForward"

    @functools.wraps(call)
    def keeping_product(self, *args, **kwargs):
        # Recomputed (with its block, or alone under "layer"), a standard FeedForward's
        # GELU keeps only its input in the recomputation's backward pass, which runs in
        # chunks of rows; under "block_keep_ffn" its second product is kept from the
        # forward pass for the recomputation (`_feed_forward.lean_call`).
        if (engine.inside_recomputed_call() and len(args) == 1 and not kwargs
                and _feed_forward.lean_applies(self, args[0])):
            return _feed_forward.lean_call(
                self, args[0], keep_product=_policy_of(self) == "block_keep_ffn",
                skip_product=_norm_from_output.skips_product(self))
        return call(self, *args, **kwargs)

    @functools.wraps(call)
    def from_output(self, *args, **kwargs):
        # a block's last LayerNorm under "block": its gradient from the block's output
        return _norm_from_output.norm_call(self, call, args, kwargs)

    decorated = recompute_grad(keeping_product if feed_forward else from_output if norm else call)

    def wrapper(self, *args, **kwargs):
        if norm and _policy_of(self) == "attention" and _config.is_enabled() \
                and len(args) == 1 and not kwargs:
            return _feed_forward.remade_from_input(
                decorated(self, *args), args[0], lambda x: call(self, x))
        if _policy_of(self) != "attention" or elementwise:
            return decorated(self, *args, **kwargs)
        if not _config.is_enabled():
            return call(self, *args, **kwargs)
        if feed_forward and len(args) == 1 and not kwargs and _feed_forward.lean_applies(self, args[0]):
            return _feed_forward.lean_call(self, args[0])
        _selective.depth = getattr(_selective, "depth", 0) + 1
        try:
            with _feed_forward.dense_inputs_remade(self, args[0] if args else kwargs.get("inputs")):
                return call(self, *args, **kwargs)
        finally:
            _selective.depth -= 1

    functools.update_wrapper(wrapper, call)
    wrapper.__signature__ = inspect.signature(call)  # tf_keras passes `mask`/`training` by it
    wrapper.__recompute_grad_wrapped__ = call
    return wrapper


def _custom_objects(module):
    """The Keras custom objects bert4keras registers its "gelu" in, or None."""
    keras = getattr(module, "keras", None)
    utils = getattr(keras, "utils", None)
    return utils.get_custom_objects() if utils is not None else None


def _gelu(gelu):
    """bert4keras's "gelu" (`gelu_erf`): as written, except inside a `FeedForward`
    under the "attention" policy with recomputation on, where it keeps only its
    input for the gradient (`_feed_forward.gelu_grad`)."""
    import tensorflow as tf

    @tf.custom_gradient
    def gelu_keeping_input(x):
        return gelu(x), lambda dy: _feed_forward.gelu_grad(after([x], dy)[0], dy)

    def selective_gelu(x):
        if getattr(_selective, "depth", 0) and _feed_forward.is_gelu_erf(gelu):
            return gelu_keeping_input(x)
        return gelu(x)

    functools.update_wrapper(selective_gelu, gelu)  # serialized under gelu's own name
    return selective_gelu


def _pay_attention_arguments(args, kwargs):
    """`(inputs, mask, other keyword arguments)` of a `pay_attention_to(inputs, mask=None, **kwargs)` call."""
    kwargs = dict(kwargs)
    inputs = args[0] if args else kwargs.pop("inputs")
    mask = args[1] if len(args) > 1 else kwargs.pop("mask", None)
    return inputs, mask, kwargs


def _attending_to(pay_attention_to):
    """`pay_attention_to`, which creates its `Dropout` once (`_owned_dropout`). With
    recomputation on it is lean in the standard case (`_attention`: fewer [seq, seq]
    tensors in the working set of the recomputed layer or block) and, under the
    "attention" policy, keeps only its inputs and is recomputed."""

    def attending(self, *args, compute=pay_attention_to, **kwargs):
        with _attending.entered(self):
            return compute(self, *args, **kwargs)

    def lean(self, inputs, mask=None, **kwargs):
        # the core's rule (`_flash.runs_blocked`) by policy: whole blocks recomputed, or not
        policy = "block" if _policy_of(self) in BLOCK_POLICIES else None
        if _attention.lean_applies(self, inputs, kwargs, policy):
            dropout = sys.modules[type(self).__module__].Dropout  # `_owned_dropout`
            return _attention.lean_pay_attention_to(self, inputs, mask, dropout, policy=policy)
        return pay_attention_to(self, inputs, mask, **kwargs)

    def recomputed(self, *args, **kwargs):
        return attending(self, *args, compute=lean, **kwargs)

    def recomputed_unit(self, inputs, mask, scores_asked):
        dropout = sys.modules[type(self).__module__].Dropout
        return _attention.lean_pay_attention_to(self, inputs, mask, dropout, scores_asked,
                                                "attention")

    def wrapper(self, *args, **kwargs):
        if not _config.is_enabled():
            return attending(self, *args, **kwargs)  # RECOMPUTE=0: bert4keras's own code
        if _policy_of(self) != "attention":
            return recomputed(self, *args, **kwargs)  # lean inside the recomputed layer or block
        adapter = _backends.adapter_for(self)
        adapter.check_supported(self)
        keep = bool(getattr(self, "return_attention_scores", True))
        inputs, mask, rest = _pay_attention_arguments(args, kwargs)
        if (engine.TensorFlowEngine.recomputes()
                and _attention.lean_applies(self, inputs, rest, "attention")):
            engine.check_recomputable(adapter, self, engine.float_tensors(inputs))
            return attending(self, inputs, mask, keep, compute=recomputed_unit)
        return _registry.recompute_core(adapter, recomputed, self, args, kwargs, keep)

    functools.update_wrapper(wrapper, pay_attention_to)
    return wrapper


def _patch_module(module):
    for classes, method, replacement in (
            (marked_classes(module), "call", lambda current, cls: _marked_call(_undecorated(current), cls)),
            (_attention_classes(module), "pay_attention_to", lambda current, cls: _attending_to(current))):
        for cls in classes:
            if (cls, method) not in _replaced:
                current = cls.__dict__[method]
                _replaced[cls, method] = current
                setattr(cls, method, replacement(current, cls))
    objects = _custom_objects(module)
    if module not in _module_gelu and objects is not None and "gelu" in objects:
        _module_gelu[module] = objects["gelu"]
        objects["gelu"] = _gelu(objects["gelu"])
    _patch_dropout(module)


def _patch_dropout(module):
    """`module.Dropout` (bert4keras's layers' and models' name for tf_keras's) becomes
    `_owned_dropout`'s, once; `unpatch()` restores it."""
    dropout = getattr(module, "Dropout", None)
    if module not in _module_dropout and dropout is not None \
            and getattr(dropout, "__wrapped__", None) is None:
        _module_dropout[module] = dropout
        module.Dropout = _owned_dropout(dropout)


_block_warned = set()  # model classes warned about per-layer recomputation


def _block_inputs_ok(model, inputs, index):
    """Why a BERT block of `model` cannot be one recomputed unit, or None if it can."""
    if isinstance(inputs, (list, tuple)):
        return "its blocks take several inputs"
    if model.compute_attention_bias(index) is not None:
        return "its blocks take an attention bias computed outside them"
    if model.layer_norm_conds[0] is not None:
        return "it uses conditional layer normalization"
    if model.attention_caches:
        return "it uses attention caches"
    if model.residual_attention_scores:
        return "it passes attention scores from block to block"
    return None


def _recomputed_blocks(apply_main_layers, keras):
    """BERT's `apply_main_layers`, building each Transformer block as one recomputed unit.

    bert4keras builds a block as separate layers: attention, dropout, residual
    add, layer norm, feed-forward, dropout, add, layer norm. Recomputing each
    marked layer alone keeps every tensor that passes between them (about
    4.5x a block's input per block). Here the block becomes a nested
    functional model named `Transformer-<i>` whose `call` is decorated with
    `recompute_grad`: the forward pass keeps only the block's input. The
    layers inside are the same objects under the same names (bert4keras's
    weight loading finds them in `model.layers`), the padding mask reaches
    them as before, and the marked layers inside run plainly within the
    block's recomputation (the outermost decorated call is the unit). Each
    sample of a block is computed from that sample alone: declared so
    (`recompute.policies._blocks.declare_per_sample`), its recomputation runs
    its batch in cuts (`recompute.batch_cut`). Under "block" its last LayerNorm
    and its FeedForward are marked (`_norm_from_output.mark`): the recomputation
    takes the LayerNorm's gradient from the block's output and skips the
    FeedForward's second product.
    """

    @functools.wraps(apply_main_layers)
    def wrapper(self, inputs, index):
        if _policy not in BLOCK_POLICIES:
            return apply_main_layers(self, inputs, index)
        reason = _block_inputs_ok(self, inputs, index)
        if reason is not None:
            if type(self) not in _block_warned:
                _block_warned.add(type(self))
                warnings.warn(
                    f"recompute.bert4keras: {type(self).__name__} blocks are recomputed "
                    f"layer by layer, not as whole blocks, because {reason}; this saves "
                    "less memory.",
                    stacklevel=2,
                )
            return apply_main_layers(self, inputs, index)
        block_input = keras.layers.Input(
            shape=tuple(inputs.shape[1:]), dtype=inputs.dtype,
            name=self.prefixed(f"Transformer-{index}-Input"),
        )
        outputs = apply_main_layers(self, block_input, index)
        block = keras.models.Model(block_input, outputs, name=self.prefixed(f"Transformer-{index}"))
        block.call = recompute_grad(block.call)
        _blocks.declare_per_sample(block)  # its recomputation may run by cuts of the batch
        if _policy == "block":  # its last LayerNorm's gradient from its output
            _norm_from_output.mark(block, keras)
        return block(inputs)

    return wrapper


def _patch_models_module(module):
    bert = getattr(module, "BERT", None)
    if bert is not None and (bert, "apply_main_layers") not in _replaced:
        current = bert.__dict__["apply_main_layers"]
        _replaced[bert, "apply_main_layers"] = current
        bert.apply_main_layers = _recomputed_blocks(current, module.keras)
    _patch_dropout(module)  # imported before `patch()`: its blocks' dropouts


_PATCHERS = {MODULE: _patch_module, MODELS_MODULE: _patch_models_module}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: patches `bert4keras.layers` as soon as it has been executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _hook is not None:
            _PATCHERS[module.__name__](module)


# What bert4keras (`strtobool(TF_KERAS)`) and TensorFlow (`tf.keras` -> tf_keras) accept as on.
_TF_KERAS_ON = ("y", "yes", "t", "true", "on", "1")
_LEGACY_KERAS_ON = ("true", "True", "1")  # TensorFlow's lazy loader; accum._dispatch reads it so too


def _check_environment():
    """Raises unless bert4keras will load on tf_keras (`TF_KERAS=1 TF_USE_LEGACY_KERAS=1`)."""
    if MODULE in sys.modules:
        return  # bert4keras.layers loaded already: its environment was right
    tf_keras_flag = os.environ.get("TF_KERAS")
    legacy_flag = os.environ.get("TF_USE_LEGACY_KERAS")
    if (tf_keras_flag or "").lower() in _TF_KERAS_ON and legacy_flag in _LEGACY_KERAS_ON:
        return
    raise RuntimeError(
        "bert4keras 0.11.5 runs on tf_keras only: it needs the environment variables "
        "`TF_KERAS=1` (bert4keras then uses `tf.keras`) and `TF_USE_LEGACY_KERAS=1` "
        "(`tf.keras` is then tf_keras, not Keras 3), set before Python starts "
        "(`TF_KERAS=1 TF_USE_LEGACY_KERAS=1 python train.py`); without them, "
        "importing bert4keras fails. "
        f"Received: TF_KERAS={tf_keras_flag!r}, TF_USE_LEGACY_KERAS={legacy_flag!r}"
    )


def patch(policy=None, *, blocks=None, offload=False):
    """Makes bert4keras recompute with `recompute_grad` (idempotent).

    Turn recomputation on with `RECOMPUTE=1` or `recompute.recompute_scope(True)`.
    Needs `TF_KERAS=1 TF_USE_LEGACY_KERAS=1` in the environment (as bert4keras
    does); without them, `patch()` raises `RuntimeError` naming both.

    Args:
        policy: what is recomputed (the trade-off is measured in docs/bert.md).
            "layer" (default): each layer bert4keras marks (attention,
            feed-forward, layer norm, ...) is a unit; the model is built as
            bert4keras builds it. "block": each BERT Transformer block of models
            built from now on is one nested model `Transformer-<i>`, recomputed
            as a unit, its batch in cuts (`recompute.batch_cut`): the least memory
            (only the block's input and its attention dropout's bits are kept; the
            recomputation takes each block's last LayerNorm's gradient from the block's
            output, `_norm_from_output`, and so skips the FeedForward's second product:
            it raises `InvalidArgumentError` where a gamma of that LayerNorm has an
            entry equal to 0), but the block's layers are reached through it
            (`model.get_layer("Transformer-3").get_layer(...)`) and a model
            reloaded with `load_model` has undecorated blocks (decorate each
            block's bound call again). "attention": selective recomputation
            -- the attention probabilities (`pay_attention_to`: scores,
            mask, softmax, dropout) and the element-wise work (layer norms;
            the FeedForward's GELU keeps only its input) are recomputed, the
            outputs of the dense layers are kept: much of the memory for
            little time. "block_keep_ffn": "block", except that each
            FeedForward's output product is kept from the forward pass
            (one [seq, hidden] tensor per block and sample), so the
            recomputation skips that product, 30% of the block's forward
            FLOPs at BERT-base (`_feed_forward.lean_call`; float32,
            bert4keras's GELU; elsewhere as "block"), and the last
            LayerNorm's gradient is taken from its input (any gamma).
            Layers take the policy in effect at their first call (when the
            model is built); weights, checkpoints and outputs are the same
            under every policy.
        blocks: the older spelling: `blocks=True` is `policy="block"`,
            `blocks=False` is `policy="layer"`.
        offload: False, the only value here: bert4keras runs on tf_keras
            (TensorFlow), which has no host offload; `offload=True` keeps a
            recomputed call's inputs in host memory on Keras 3's JAX backend only
            (`recompute_grad(offload=True)`, `recompute.keras_hub.patch(offload=True)`).

    Raises:
        ValueError: an unknown policy, `blocks` contradicting `policy`, or
            `offload=True`.
        RuntimeError: the environment variables above are missing.
    """
    global _policy
    if offload is not False:
        raise ValueError(
            "recompute.bert4keras.patch(offload=True): bert4keras runs on tf_keras (TensorFlow), "
            "which has no host offload; offload=True is Keras 3's JAX backend's "
            "(recompute_grad, recompute.keras_hub.patch). Received: offload=" + repr(offload))
    if blocks is not None and not isinstance(blocks, bool):
        raise TypeError(f"`blocks` must be True or False. Received: blocks={blocks!r}")
    if policy is not None:
        _registry.check_policy(policy, POLICIES)
    if blocks is not None:
        implied = "block" if blocks else "layer"
        if policy is not None and policy != implied:
            raise ValueError(
                f"`blocks={blocks}` means policy={implied!r}; pass one of them. "
                f"Received: policy={policy!r}, blocks={blocks!r}"
            )
        policy = implied
    _check_environment()
    _policy = policy or "layer"
    global _hook
    waiting = False
    for name, patch_module in _PATCHERS.items():
        module = sys.modules.get(name)
        if module is not None:
            patch_module(module)
        else:
            waiting = True
    if waiting and _hook is None:
        _hook = _PatchOnImport()
        sys.meta_path.insert(0, _hook)


def unpatch():
    """Restores bert4keras's own methods and removes the import hook (idempotent).

    Models built while patched keep their structure (blocks as nested models)
    and still recompute when `RECOMPUTE` is on.
    """
    global _hook, _policy
    _policy = "layer"
    if _hook is not None:
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
    for (cls, name), original in list(_replaced.items()):
        setattr(cls, name, original)
        del _replaced[cls, name]
    for module, gelu in list(_module_gelu.items()):
        _custom_objects(module)["gelu"] = gelu
        del _module_gelu[module]
    for module, dropout in list(_module_dropout.items()):
        module.Dropout = dropout
        del _module_dropout[module]


def is_patched():
    """True if `patch()` is in effect (classes patched or the import hook waiting)."""
    return bool(_replaced) or _hook is not None
