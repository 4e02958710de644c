"""Recomputation policies: what a call decorated with `recompute_grad` recomputes.

A policy is one small function per engine that runs the decorated call
`fn(layer, *args, **kwargs)` when recomputation is on: on TensorFlow
`policy(adapter, fn, layer, args, kwargs)`, here, called when a tape records
(`recompute_grad` decides that and passes the layer's `_adapter.Adapter`); on
JAX `policy(fn, layer, args, kwargs)`, in `_jax`. `POLICIES`, the one registry,
names each `Policy` (both engines' functions); `recompute_grad(policy=...)`
picks one.

- `full`: the call is one unit (`_core.recomputed_call`). The forward pass keeps
  only the call's inputs; the backward pass runs the whole call again: about
  one extra forward pass of the layer. Its GELUs run as written (the GELU of
  `_gelu` measured no smaller here beyond noise, and with it Adam turned
  rounding-level differences of analytically zero gradients into whole steps
  in `fit`). On JAX a `Dense` with an activation feeding a `Dense` without one
  (a feed-forward) runs as one operation whose gradient runs in row blocks
  (`_feed_forward_jax`: the activation's gradient is autodiff's).
- `attention`: the call runs as usual and keeps its activations, except in the
  *attention core* of every multi-head attention layer it contains (Keras's
  `MultiHeadAttention._compute_attention`: scaled scores, mask, softmax,
  dropout, probabilities × values), which keeps only its inputs and the
  dropout's decision as bits and runs again in the backward pass: the
  selective recomputation of Megatron-LM (Korthikanti et al., 2022). Exact
  GELUs of `Dense` sublayers keep only their input (`_gelu`: a custom gradient
  on TensorFlow, `jax.checkpoint` on JAX): one [seq, ffn] tensor per GELU
  instead of four; on TensorFlow LayerNorms keep only their input too, and the
  `Dense` a GELU or a LayerNorm feeds computes its product under a gradient that
  makes that input again, as do the next block's query, key and value projections
  fed the block's output (`_lean.lean_layers`); on JAX the block is one checkpoint
  that keeps named values (`_jax`).

Under both, Keras's own cores run as the blocked attention core
(`_attention.keras_blocked`, `_flash`): one block of query rows alive at a time,
forward and backward, the dropout's decision drawn once by the layer's own
dropout and kept as bits (through the recomputation of "full" too: `_core.kept`);
losses and gradients equal RECOMPUTE=0's to float rounding. A core that is not
the standard case runs as written: under "attention" recomputed as a call of
its own (its dropout replayed), under "full" with the call.

`recompute_core` recomputes one such core; `recompute.bert4keras` uses it for
bert4keras's `pay_attention_to`.
"""

import contextlib
from typing import Callable, NamedTuple

from ..adapters import _keras3, _mha_private
from ..ops import _attention, _flash_tf, _lean, _window_tf
from ..engine import TensorFlowEngine, _core, _cuts_tf
from . import _blocks, _jax
from .._scoped import shadowed


def full(adapter, fn, layer, args, kwargs):
    """The whole call is recomputed; its attention cores follow the rule (`_flash`). A Keras 3
    block of Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers
    (`_blocks.cut_samples`), or a tf_keras layer declared to compute each sample alone
    (`_blocks.declared_cut_samples`: bert4keras's blocks), whose batch is more than one cut
    (`recompute.batch_cut`) runs in cuts of its batch (`recompute.engine._cuts_tf`), its
    random draws the whole batch's numbers for each cut (`_window_tf.windowed_draws`)."""
    sublayers = adapter.sublayers(layer)
    layers = adapter.attention_layers(sublayers)
    samples = _blocks.cut_samples(layer, sublayers, layers, args, kwargs, "tensorflow") \
        if adapter is _keras3 else _blocks.declared_cut_samples(layer, sublayers, args, kwargs)
    if layers:
        fn = _attention.with_blocked_cores(fn, lambda: _cores_recomputed(adapter, layers, "full"))
    if samples is not None:  # (a tensor where counted when the step runs)
        fn = _attention.with_blocked_cores(
            fn, lambda: _window_tf.windowed_draws(adapter, sublayers))
    return _cuts_tf.recomputed_call(adapter, fn, layer, args, kwargs, samples)


def attention(adapter, fn, layer, args, kwargs):
    """Only the attention cores of the call's multi-head attention layers are recomputed."""
    layers = _attention.attention_layers(adapter, layer)
    with _cores_recomputed(adapter, layers, "attention"), \
            _lean.lean_layers(adapter.sublayers(layer), adapter.tf_variable):
        return fn(layer, *args, **kwargs)


class Policy(NamedTuple):
    """How each engine runs a decorated call under one `policy=` name."""

    tensorflow: Callable  # (adapter, fn, layer, args, kwargs): this module's
    jax: Callable  # (fn, layer, args, kwargs, offload=False): `_jax`'s


POLICIES = {"full": Policy(full, _jax.full), "attention": Policy(attention, _jax.attention)}
NAMES = tuple(POLICIES)  # exported as `recompute.POLICIES`


def check_policy(policy, names=NAMES):
    """Raises unless `policy` is one of `names` (by default the policies of `POLICIES`)."""
    if not isinstance(policy, str) or policy not in names:
        raise ValueError(
            f"`policy` must be one of {', '.join(repr(p) for p in names)}. "
            f"Received: policy={policy!r}"
        )


def recompute_core(adapter, core, layer, args, kwargs, keep_scores):
    """Runs `core(layer, *args, **kwargs)`, which returns `(output, scores)`, so that
    it keeps only its inputs and is recomputed for the gradient.

    `scores` comes back as None unless `keep_scores` (then it is an output of
    the recomputation too). Runs `core` plainly when no tape records or inside
    a recomputed call (which recomputes the core with everything else).
    """
    if not TensorFlowEngine.recomputes():
        return core(layer, *args, **kwargs)

    def output_and_asked_scores(lyr, *a, **k):
        output, scores = core(lyr, *a, **k)
        return output, (scores if keep_scores else None)

    return _core.recomputed_call(adapter, output_and_asked_scores, layer, args, kwargs)


_MARK = "__recompute_core__"


def _class_core(adapter, core, policy):
    """The class's core `core` (a function of the layer): the blocked core of
    `_attention.keras_blocked` where it applies (the dropout drawn once, its
    decision kept as bits), else as written, by `recompute_core`. `policy`: the policy's
    name, for the core's rule (`_flash.runs_blocked`)."""

    def recomputed(layer, *args, **kwargs):
        keep_scores = adapter.scores_asked(args, kwargs)
        if TensorFlowEngine.recomputes():
            _core.check_recomputable(adapter, layer, _core.float_tensors((args, kwargs)))
        blocked = _attention.keras_blocked(_flash_tf, core, layer, args, kwargs, keep_scores,
                                           policy)
        if blocked is not None:
            return blocked
        if policy == "full" and adapter is _keras3:  # Keras's core: its decision drawn once
            with _window_tf.decided_once([_mha_private.own_dropout(layer)]):
                return recompute_core(adapter, core, layer, args, kwargs, keep_scores)
        return recompute_core(adapter, core, layer, args, kwargs, keep_scores)

    return recomputed


def _own_core(adapter, own):
    """An instance's own core (bound): recomputed as written, never lean."""

    def recomputed(layer, *args, **kwargs):
        keep_scores = adapter.scores_asked(args, kwargs)
        return recompute_core(adapter, lambda lyr, *a, **k: own(*a, **k), layer, args, kwargs,
                              keep_scores)

    return recomputed


@contextlib.contextmanager
def _cores_recomputed(adapter, layers, policy):
    """While active, the attention core of each of `layers` keeps only its inputs,
    is recomputed, and is lean where it can be (`_attention`).

    The core is the layer's method `adapter.attention_core`; it is shadowed by
    an instance attribute (the class and other instances are untouched) and
    restored on exit. A core shadowed already -- by an enclosing decorated call
    -- is left as it is. `policy` ("full", "attention") goes to the core's rule.
    """
    name = adapter.attention_core

    def core_of(layer, own):
        recomputed = _class_core(adapter, getattr(type(layer), name), policy) if own is None \
            else _own_core(adapter, own)

        def core(*args, **kwargs):
            return recomputed(layer, *args, **kwargs)

        setattr(core, _MARK, True)
        return core

    owns = ((layer, vars(layer).get(name)) for layer in layers)
    with shadowed((layer, name, core_of(layer, own)) for layer, own in owns
                  if not getattr(own, _MARK, False)):
        yield
