"""The interface between accumulation and the optimizer it wraps, one module per Keras family.

What accumulation needs of a wrapped optimizer beyond its public API -- a
variable's key, whether weight decay applies to it, its moment slots, the
learning rate of the next update, the names of the per-variable update
methods a masked update guards, how to skip the all-reduce inside its update,
its loss scale -- is asked of the family's module: `accum.keras3._inner` (Keras 3,
TensorFlow and JAX backends), `accum.tf_keras._inner` (tf_keras new-style) and
`accum.tf_keras._inner_legacy` (tf_keras legacy `OptimizerV2`). Each defines every
name of `InnerApi` below, as module-level functions and constants, and is, with the
readers of this module it takes as its own (below the protocol), the only place in
`accum` where private names of a wrapped optimizer are touched; each lists those it
relies on in `PRIVATE_NAMES`, pairs `(attribute, owners)`:
an attribute (a dotted path for an attribute of an attribute) that each owner
-- an optimizer class, built, or a module, by its import path -- must have.
The interface tests (tests/accum_keras3/test_inner_interface.py,
tests/accum_tf_keras/test_inner_interface_tf_keras.py) check every member and
every private name against the installed Keras, so a Keras upgrade that
renames one fails there. A member that does not apply to a family returns a
value that says so (None, False, a context that does nothing); a family module
may define a few more functions only its own wrapper uses (the legacy one's
`compute_gradients`).

Keras 3's `Optimizer` and tf_keras's new-style one keep the same private state under
the same names (`_var_key`, `_use_weight_decay`, `_variables`, `_iterations`, the
`momentums`/`_momentums`/`_velocities` slot lists): the functions below the protocol
read it once for both; `accum.keras3._inner` and `accum.tf_keras._inner` take them
as their own and list those names in their `PRIVATE_NAMES`, checked there against
each installed Keras.
"""

from typing import Any, ContextManager, Hashable, Optional, Protocol, Sequence, Tuple



class InnerApi(Protocol):
    """What accumulation needs to know about a wrapped optimizer of one Keras family."""

    name: str  # the family (`accum._families`)
    # The optimizer's per-variable update methods, each called `(gradient, variable, ...)`;
    # a masked update guards each (`accum.modes._window.masked_update_hooks`). The first is the
    # one the others run (tf_keras's `_update_step_xla` runs `_update_step` under XLA).
    UPDATE_STEPS: Tuple[str, ...]
    # The method applying decoupled weight decay to a list of variables (None: the family
    # has none).
    WEIGHT_DECAY: Optional[str]

    def var_key(self, optimizer: Any, variable: Any) -> Hashable:
        """The key under which `optimizer` knows `variable` (also for a replica's component)."""

    def uses_weight_decay(self, optimizer: Any, variable: Any) -> bool:
        """Whether `optimizer`'s weight decay applies to `variable` (False without one)."""

    def apply_weight_decay(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """`optimizer`'s decoupled weight decay of `variables`, at the current learning rate
        (nothing without one)."""

    def has_momentum(self, optimizer: Any) -> bool:
        """Whether `optimizer` keeps a heavy-ball momentum slot (SGD, RMSprop with a
        momentum that is not 0); False for other optimizers."""

    def slots(self, optimizer: Any, variable: Any) -> Optional[tuple]:
        """The moments of `variable` in a built `optimizer`, as its variables: `(momentum,)`
        for SGD, `(m, v)` for Adam and AdamW (an element None where the slot is missing);
        None for other optimizers."""

    def current_learning_rate(self, optimizer: Any, dtype: Any = None) -> Any:
        """The learning rate of `optimizer`'s next update (a schedule at its `iterations`),
        cast to `dtype` (None: as the optimizer holds it; legacy: float32)."""

    def step_hooks(self, optimizer: Any, iterations: Any, learning_rate: Any) -> Optional[dict]:
        """The instance attributes (name -> value) under which `optimizer`'s update counts
        its step in the variable `iterations`, uses `learning_rate` and applies no weight
        decay; None where its update cannot be so steered (legacy: fused kernels)."""

    def skip_all_reduce(self, optimizer: Any) -> ContextManager[None]:
        """A context in which `optimizer`'s update does not all-reduce its gradients (does
        nothing where its `apply_gradients` takes an argument for that)."""

    def loss_scale(self, optimizer: Any) -> Optional[tuple]:
        """`(scale, counter)`: the variables of a dynamic loss-scaling `optimizer`, its
        current loss scale and its count of finite steps since the scale last changed;
        None for an optimizer that scales no loss dynamically."""

    def build(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Creates `optimizer`'s slots for `variables` (legacy: those it has not seen)."""


MEMBERS = [name for name in InnerApi.__annotations__] + [
    name for name, value in vars(InnerApi).items() if callable(value) and not name.startswith("_")
]


def owned_by(owners, *attributes):
    """`PRIVATE_NAMES` entries: each of `attributes`, on each of `owners`."""
    return tuple((attribute, owners) for attribute in attributes)


# Shared by `accum.keras3._inner` and `accum.tf_keras._inner` (see the module's docstring).


def shared_private_names(every, adam, wrapper_base):
    """The `PRIVATE_NAMES` entries of the readers below, for a family whose optimizers are
    `every`, whose Adam and AdamW are `adam` and whose wrapper's base class is
    `wrapper_base` (owners, by import path)."""
    return (owned_by(every, "_var_key", "_use_weight_decay")
            + owned_by(adam, "_momentums", "_velocities")
            + owned_by(wrapper_base, "_variables", "_iterations"))


def var_key(optimizer, variable):
    return optimizer._var_key(variable)


def uses_weight_decay(optimizer, variable):
    return optimizer._use_weight_decay(variable)


def has_momentum(optimizer):
    return bool(getattr(optimizer, "momentum", 0))


def build(optimizer, variables):
    optimizer.build(variables)


def moment_slots(optimizer, variable, index_of, sgd, adam):
    """`InnerApi.slots`: the moments of `variable` (at `index_of(optimizer, variable)` in
    the slot lists) of an `sgd` or `adam` (class, or tuple of classes) `optimizer`."""
    if isinstance(optimizer, sgd):
        return (optimizer.momentums[index_of(optimizer, variable)],)
    if isinstance(optimizer, adam):
        i = index_of(optimizer, variable)
        return (optimizer._momentums[i], optimizer._velocities[i])
    return None


def reader(attribute, doc):
    """The function `f(optimizer)` returning `optimizer`'s private `attribute` (listed in
    `PRIVATE_NAMES` by the family module that defines `f`), documented by `doc`."""

    def read(optimizer):
        return getattr(optimizer, attribute)

    read.__doc__ = doc
    return read


# The wrapper's own base-class state, the same in both (each lists it in `_WRAPPER_BASE`).
own_variables = reader(
    "_variables", "The list of `optimizer`'s own variables (the base class's; appended to in place).")
own_iterations = reader("_iterations", "`optimizer`'s own step counter, the variable behind `iterations`.")
