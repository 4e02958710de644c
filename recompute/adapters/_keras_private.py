"""The private Keras 3 names that `recompute` relies on (besides `MultiHeadAttention`'s,
in `recompute.adapters._mha_private`), read here and nowhere else.

Keras 3 has no public API for: a layer's sublayers, flattened (`_flatten_layers`); the
losses a layer's call added (`_losses`, `_loss_ids`); the backend value behind a
variable (`_value`); the Keras mask on a tensor (`_keras_mask`, which tf_keras names
alike); its global state (the current call context, the variables a stateless scope
deferred, the global seed generator); the autocast, symbolic and stateless scopes;
whether JAX traces the call; the seed a `SeedGenerator` draws; and where Keras 3's
layers and its exact GELU are defined (the modules under `keras.src`).

`PRIVATE_NAMES` lists them as `(attribute, owners)`, in the format of `recompute.adapters._names` (`accum._inner`'s):
an attribute (a dotted path for an attribute of an attribute) that each owner must
have -- a module or a class by its import path (an instance of the class where the
interface test builds one), or a description of an object the test makes (`MASKED`).
tests/recompute_keras3/test_private_interface.py checks them against the installed
Keras, so that a Keras release that renames one fails there, naming it.

Not listed (they are names, not attributes): the keys of Keras's global state this
module reads (`CURRENT_CALL_CONTEXT`, `UNINITIALIZED_VARIABLES`); the test checks that
a layer's call sets the first.
"""

import contextlib
import types

from ._names import owned_by

LAYER = "keras.layers.Layer"
VARIABLE = "keras.Variable"
MASKED = "a tensor a keras.layers.Masking call returns"
_GLOBAL_STATE = "keras.src.backend.common.global_state"
_SEED_GENERATOR = "keras.src.random.seed_generator"

MODULE_PREFIX = "keras.src."  # the modules Keras 3's classes are defined in
GELU = ("keras.src.activations.activations", "gelu")  # (module, name) of the exact GELU
DENSE = ("keras.src.layers.core.dense", "Dense")  # (module, name) of `keras.layers.Dense`
# (module, name) of `keras.layers.EinsumDense`
EINSUM_DENSE = ("keras.src.layers.core.einsum_dense", "EinsumDense")
# (module, name) of `keras.layers.LayerNormalization`
LAYER_NORMALIZATION = ("keras.src.layers.normalization.layer_normalization",
                       "LayerNormalization")
DROPOUT = ("keras.src.layers.regularization.dropout", "Dropout")  # (module, name) of `keras.layers.Dropout`
CURRENT_CALL_CONTEXT = "current_call_ctx"
UNINITIALIZED_VARIABLES = "uninitialized_variables"

PRIVATE_NAMES = (
    owned_by((LAYER,), "_flatten_layers", "_losses", "_loss_ids")
    + owned_by((VARIABLE,), "_value")
    + owned_by((MASKED,), "_keras_mask")
    + owned_by((_GLOBAL_STATE,), "get_global_attribute", "set_global_attribute")
    # `jax_utils.is_in_jax_tracing_scope` is replaced for a while
    + owned_by((_SEED_GENERATOR,), "GLOBAL_SEED_GENERATOR", "global_seed_generator", "draw_seed",
               "jax_utils.is_in_jax_tracing_scope")
    + owned_by(("keras.src.backend",), "get_autocast_scope", "AutocastScope")
    + owned_by(("keras.src.backend.common.symbolic_scope",), "in_symbolic_scope")
    + owned_by(("keras.src.backend.common.stateless_scope",), "get_stateless_scope")
    + owned_by(("keras.src.utils.jax_utils",), "is_in_jax_tracing_scope")
    + owned_by((GELU[0],), GELU[1])
    + owned_by((DENSE[0],), DENSE[1])
    + owned_by((EINSUM_DENSE[0],), EINSUM_DENSE[1])
    + owned_by((LAYER_NORMALIZATION[0],), LAYER_NORMALIZATION[1])
    + owned_by((DROPOUT[0],), DROPOUT[1])
)


def flatten_layers(layer, include_self=True):
    """`layer`'s sublayers, recursively (`layer` itself first if `include_self`)."""
    return layer._flatten_layers(include_self=include_self, recursive=True)


def losses(layer):
    """The list of the loss tensors `layer`'s calls added (`add_loss`), itself."""
    return layer._losses


def clear_loss_ids(layer):
    """Forgets which losses `layer` was given (so that the same tensor may be added again)."""
    layer._loss_ids.clear()


def backend_value(variable, *default):
    """The backend value behind a Keras 3 variable (a `tf.Variable`, a JAX array);
    `default` (if given) for an object without one."""
    return getattr(variable, "_value", *default)


def keras_mask(tensor):
    """The Keras mask attached to `tensor`, or None."""
    return getattr(tensor, "_keras_mask", None)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` (an AttributeError for a tensor that takes no attributes)."""
    tensor._keras_mask = mask


def global_attribute(name, default=None, set_to_default=False):
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(name, default, set_to_default=set_to_default)


def set_global_attribute(name, value):
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(name, value)


def global_seed_generator():
    """The global seed generator (unseeded `keras.random` calls draw from it), or None if
    none exists yet."""
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    return global_attribute(GLOBAL_SEED_GENERATOR)


def create_global_seed_generator():
    """Creates the global seed generator if it does not exist yet."""
    from keras.src.random import seed_generator

    seed_generator.global_seed_generator()


@contextlib.contextmanager
def global_seed_draws_untraced():
    """A context in which the global seed generator takes every call for an untraced one
    (it refuses to draw in traced JAX code)."""
    from keras.src.random import seed_generator

    original = seed_generator.jax_utils
    seed_generator.jax_utils = types.SimpleNamespace(is_in_jax_tracing_scope=lambda x=None: False)
    try:
        yield
    finally:
        seed_generator.jax_utils = original


def draw_seed(generator):
    """The seed `generator` (a `SeedGenerator`) hands out next, as Keras's random ops draw it."""
    from keras.src.random.seed_generator import draw_seed

    return draw_seed(generator)


def autocast_scope():
    """The active autocast scope (mixed precision), or None."""
    from keras.src import backend

    return backend.get_autocast_scope()


def autocast(dtype):
    """An autocast scope to `dtype`."""
    from keras.src import backend

    return backend.AutocastScope(dtype)


def in_symbolic_scope():
    """True while Keras infers output shapes (`compute_output_spec`, a symbolic build)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def stateless_scope():
    """The active `StatelessScope`, or None."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def in_jax_tracing_scope():
    """True while JAX traces the call."""
    from keras.src.utils.jax_utils import is_in_jax_tracing_scope

    return is_in_jax_tracing_scope()
