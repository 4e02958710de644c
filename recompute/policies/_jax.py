"""The policies' functions on Keras 3's JAX backend, run by the JAX engine
(`recompute.engine._jax`: the call as a `jax.checkpoint`, the layer's state threaded
through): `full` (the whole call one checkpoint) and `attention` (the attention cores
and the GELUs checkpointed inside a call that keeps the rest; a block of Keras's
attention, `Dense`, `LayerNormalization` and `Dropout` layers one checkpoint keeping the
values named `KEPT`); `_policies.POLICIES` names both engines' functions.
"""

import contextlib

from ..adapters import _keras3
from ..engine import _jax as _engine, _running
from .._errors import offload_refused
from .._scoped import shadowed
from ._blocks import cut_samples, kept_block


def full(fn, layer, args, kwargs, offload=False):
    """The whole call is one `jax.checkpoint`: it keeps its inputs (with `offload`, in pinned
    host memory), runs again in the backward pass; its attention cores run blocked
    (`_flash`), where Keras's own core runs its dropout draws once its input exists
    (`_dropouts_gated`), and its feed-forward pairs (a `Dense` with an activation feeding
    one without) take their gradient in row blocks (`_feed_forward_jax`), in both passes.
    A block of Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers whose
    batch is more than one cut (`_blocks.cut_samples`, `recompute.batch_cut`) runs in cuts of its
    batch (`recompute.engine._jax._by_samples`), every `Dropout` of it gated and drawing the
    whole batch's numbers."""
    from ..ops import _feed_forward_jax
    from ..ops._attention import with_blocked_cores

    sublayers = _keras3.sublayers(layer)
    layers = _keras3.attention_layers(sublayers)
    samples = cut_samples(layer, sublayers, layers, args, kwargs)
    dropouts = (sublayers if samples else
                [sub for lyr in layers for sub in _keras3.sublayers(lyr)])

    @contextlib.contextmanager
    def lean():
        with _cores_blocked(layers, _keras3.attention_core), \
                _feed_forward_jax.fused(sublayers), _dropouts_gated(dropouts):
            yield

    return _engine.recomputed_call(with_blocked_cores(fn, lean), layer, args, kwargs,
                                   offload=offload, samples=samples)


def attention(fn, layer, args, kwargs, offload=False):
    """Only the attention core (`MultiHeadAttention._compute_attention`) of each multi-head
    attention layer in the call keeps less: blocked (`_flash_jax`: it keeps its inputs and
    the dropout's seed), or, where the core is not the standard case, a `jax.checkpoint`
    (its dropout replayed from the seed state); and the exact GELUs of its `Dense`
    sublayers keep only their input (`_gelu.checkpointed`). Where the call is a block of
    Keras's attention, `Dense`, `LayerNormalization` and `Dropout` layers (`_blocks.kept_block`),
    the rest keeps only what the backward pass multiplies by (`_block_checkpointed`);
    elsewhere everything else is kept."""
    from ..ops import _gelu
    from ..ops._attention import attention_layers  # the check and its message, shared

    if offload:
        raise ValueError(offload_refused("attention"))
    layers = attention_layers(_keras3, layer)
    sublayers = _keras3.sublayers(layer)
    block = kept_block(layer, sublayers, layers)
    with _cores_blocked(layers, _keras3.attention_core, checkpoint_others=True, named=block):
        if block:  # its GELUs recomputed by the block's checkpoint, from their named inputs
            return _block_checkpointed(fn, layer, args, kwargs, sublayers)
        with _gelu.kept_input(sublayers, _gelu.checkpointed):
            return fn(layer, *args, **kwargs)


def _dropouts_gated(sublayers):
    """While active, the Keras `Dropout` layers among `sublayers` (the attention layers'
    own -- the dropout of Keras's own core, where it runs: half precision -- or, where the
    call runs in cuts of its batch, every one of the call) draw their decision only once
    their input exists: the seed each draws (`seed_generator.next()`, as `Dropout.call`
    does) passes one optimization barrier with the input. Inside a cut
    (`_running.batch_window()`), the draw is the whole batch's, `jax.random.bernoulli` on
    its shape as Keras's `dropout` draws it, cut to the window's samples. Without the gate
    XLA:GPU computed every block's recomputed attention-dropout mask in one fusion at the
    start of the backward pass, all alive at once (keras-hub BERT-base, bfloat16, Keras's
    core: 12 [batch, 12, 512, 512] bools, 36 of 49.4 MiB per sample; docs/attention.md).
    The same draw, the same values."""
    import jax
    import keras

    def gated(layer, call):
        def run(inputs, training=False):
            if training is not True or not layer.rate or _engine.in_shape_inference():
                return call(inputs, training=training)
            seed, inputs = jax.lax.optimization_barrier((layer.seed_generator.next(), inputs))
            window = _running.batch_window()
            if window is None:
                return keras.random.dropout(inputs, layer.rate,
                                            noise_shape=layer.noise_shape, seed=seed)
            # the whole batch's draw (keras.random.dropout's), cut to the window's samples
            keep_prob = 1.0 - layer.rate
            mask = jax.random.bernoulli(seed, p=keep_prob,
                                        shape=(window.batch,) + tuple(inputs.shape[1:]))
            mask = jax.lax.dynamic_slice_in_dim(mask, window.start, window.size, 0)
            return jax.lax.select(mask, inputs / keep_prob, jax.numpy.zeros_like(inputs))

        return run

    return shadowed((sub, "call", gated(sub, sub.call)) for sub in sublayers
                    if type(sub) is keras.layers.Dropout and "call" not in vars(sub))


# What `"attention"`'s block checkpoint keeps (`jax.checkpoint_policies.save_only_these_names`)
KEPT = "recompute.attention.kept"


def kept(x):
    """`x` named `KEPT` (`jax.ad_checkpoint.checkpoint_name`) where it is a JAX array."""
    import jax

    return jax.ad_checkpoint.checkpoint_name(x, KEPT) if isinstance(x, jax.Array) else x


def kept_arrays(structure):
    """`structure` with its floating-point JAX arrays `kept` (masks and integers unnamed:
    recomputed where they are needed, as they are made cheaply)."""
    import jax
    import jax.numpy as jnp
    import keras

    def name(x):
        floating = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        return kept(x) if floating else x

    return keras.tree.map_structure(name, structure)


def _block_checkpointed(fn, layer, args, kwargs, sublayers):
    """`fn(layer, *args, **kwargs)` as one `jax.checkpoint` keeping the values named `KEPT`:
    the attention cores' queries, keys, values and outputs (`_cores_blocked`), each `Dense`
    layer's activation's input (its product, before a GELU or none) and each
    `LayerNormalization`'s output. The rest -- the attention's output projection, the
    dropouts (replayed from their seed), the residual sums, the normalizations' statistics
    -- runs again in the backward pass from those and the call's inputs."""
    import jax
    import keras

    def named_activation(activation):
        return lambda x: activation(kept(x))

    def named_call(sub, call):
        return lambda *a, **k: kept(call(sub, *a, **k))

    replaced = []
    for sub in sublayers:
        if type(sub) is keras.layers.Dense and sub.activation is not None:
            replaced.append((sub, "activation", named_activation(sub.activation)))
        elif type(sub) is keras.layers.LayerNormalization:
            replaced.append((sub, "call", named_call(sub, type(sub).call)))
    policy = jax.checkpoint_policies.save_only_these_names(KEPT)
    with shadowed(replaced):
        return _engine.recomputed_call(fn, layer, args, kwargs, policy=policy)


@contextlib.contextmanager
def _cores_blocked(layers, name, checkpoint_others=False, named=False):
    """While active, `name` (the attention core) of each layer runs as the blocked core
    where it is the standard case (`_attention.keras_blocked`), else -- with
    `checkpoint_others` -- under `recomputed_call`, else as written. An instance
    attribute shadows the method (`recompute._scoped.shadowed`), removed on exit. With
    `named`, the core's array inputs and its output are named `KEPT`."""
    from ..ops import _attention, _flash_jax

    def core_of(lyr, method):
        def core(*args, **kwargs):
            if _engine.in_shape_inference():
                return method(lyr, *args, **kwargs)
            if named:
                args, kwargs = kept_arrays((args, kwargs))
                result = unnamed(*args, **kwargs)
                if isinstance(result, tuple):
                    return (kept(result[0]),) + result[1:]
                return kept(result)
            return unnamed(*args, **kwargs)

        def unnamed(*args, **kwargs):
            blocked = _attention.keras_blocked(
                _flash_jax, method, lyr, args, kwargs, _keras3.scores_asked(args, kwargs))
            if blocked is not None:
                return blocked
            if not checkpoint_others or _running.inside_recomputed_call():
                return method(lyr, *args, **kwargs)
            return _engine.recomputed_call(method, lyr, args, kwargs)

        return core

    # a core shadowed already (an enclosing decorated call's) is left as it is
    with shadowed((lyr, name, core_of(lyr, getattr(type(lyr), name)))
                  for lyr in layers if name not in vars(lyr)):
        yield
