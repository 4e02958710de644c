"""The interface between the recomputation (`_core`) and one Keras family.

`_core` knows TensorFlow; what differs between Keras 3 (`keras`, TensorFlow
backend) and tf_keras (Keras 2, what bert4keras runs on) -- where a layer's
random and moving state lives, how its call context is re-entered, where its
losses go -- is asked of an *adapter*. There are two, the modules `_keras3` and
`_tf_keras`; each defines every name of `Adapter` below (a test checks it),
and `_backends.adapter_for(layer)` picks the one for a layer. Private Keras
and tf_keras names are used in those two modules only.
"""

from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence


class LegacyRng(Protocol):
    """Random draws that cannot be replayed from state (tf_keras's legacy stateful ops)."""

    def draw_seed(self) -> Any:
        """One seed tensor for a decorated call's draws (drawn in its forward pass)."""

    def replay(self, seed: Any) -> ContextManager[Any]:
        """While active, every legacy draw in this thread is a stateless function of `seed`.

        Yields an object whose `draws` counts the draws so redirected.
        """


class Adapter(Protocol):
    """What `_core.recomputed_call` needs to know about a layer of one Keras family."""

    name: str  # the family, for messages
    attention_core: str  # the method of a `MultiHeadAttention` that policy="attention" recomputes

    def check_decoration(self, fn: Callable) -> None:
        """Raises at decoration if this family's setup cannot serve `fn` (e.g. a backend)."""

    def check_supported(self, layer: Any) -> None:
        """Raises if `layer` cannot be recomputed (e.g. a Keras 3 backend other than TensorFlow)."""

    def sublayers(self, layer: Any) -> Sequence[Any]:
        """`layer` and every layer it contains, recursively."""

    def tf_variable(self, variable: Any) -> Any:
        """The `tf.Variable` behind one of the family's variables."""

    def state_variables(self, layer: Any) -> Sequence[Any]:
        """The non-trainable state the call may change (seeds, moving statistics, metrics)."""

    def capture_call_state(self, layer: Any) -> Callable[[], ContextManager[None]]:
        """Captures the call's Keras context now; the returned function re-enters it."""

    def replay_state(self, layer: Any, state: Sequence[Any], start: Sequence[Any]) -> ContextManager[list]:
        """Runs the recomputation from `start` (the values `state` had before the call),
        writing nothing back; yields the list of losses the recomputation adds."""

    def replay_recording(self, layer: Any, state: Sequence[Any], start: Sequence[Any],
                         assigned: Optional[dict]) -> ContextManager[list]:
        """`replay_state`; on exit `assigned` (unless None) also gets `{id(variable):
        (variable, value)}` of the variables the call assigned, with the values it left."""

    def random_states(self, layer: Any) -> Sequence[Any]:
        """The random generators' states among `state_variables(layer)`: what a cut of the
        batch may assign (`recompute.engine._cuts_tf`)."""

    def copy_output_mask(self, source: Any, target: Any) -> None:
        """Gives `target` the Keras mask `source` carries, if any."""

    def output_mask(self, tensor: Any) -> Any:
        """The Keras mask `tensor` carries, or None."""

    def set_output_mask(self, tensor: Any, mask: Any) -> None:
        """Gives `tensor` the Keras mask `mask` (nothing where it is None)."""

    def track_losses(self, layers: Sequence[Any]) -> Callable[[], list]:
        """Starts tracking `add_loss`; the returned function gives (list, index) slots."""

    def attention_layers(self, layers: Sequence[Any]) -> Sequence[Any]:
        """The family's `MultiHeadAttention` layers (subclasses included) among `layers`."""

    def scores_asked(self, args: tuple, kwargs: dict) -> bool:
        """From the arguments of an attention core: whether its caller uses the scores it returns."""

    def legacy_rng(self, layers: Sequence[Any]) -> Optional[LegacyRng]:
        """The legacy draws the call may make, or None if all its random state replays."""


MEMBERS = [name for name in Adapter.__annotations__] + [
    name for name, value in vars(Adapter).items() if callable(value) and not name.startswith("_")
]
