"""Keras's private API for a layer's own weights (app.training.zero_weights, zero_memory, zero_state), behind the same
door as app.internals: the only place app/ touches these names, checked against the installed Keras by
tests/test_internals.py. A leaf: libraries imported inside the functions.

Keras 3 keeps a layer's own weights in ``_trainable_variables`` and ``_non_trainable_variables`` (in the order it made
them) and reads each in ``call`` as an attribute (Dense's ``_kernel``); on TensorFlow a layer is also a TensorFlow
trackable that names each attribute's variable as a dependency. ZeRO's stage 3 puts another variable in a weight's
place in all three, past Keras's own tracking (which refuses new state once a layer is built).
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def layers_of(model: Any) -> list[Any]:
    """The model and every layer inside it, each once, outermost first."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def own_trainable(layer: Any) -> list[Any]:
    """The trainable weights ``layer`` made itself (not its sublayers'), in order."""
    return list(getattr(layer, "_trainable_variables", None) or [])


def keeps_state(layer: Any) -> bool:
    """Whether ``layer`` holds non-trainable weights of its own (batch-norm statistics)."""
    return bool(getattr(layer, "_non_trainable_variables", None))


def draws_random(layer: Any) -> bool:
    """Whether ``layer`` holds a seed generator of its own (dropout inside it)."""
    return bool(getattr(layer, "_seed_generators", None))


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The variables a built optimizer updates, in the order it was built on ([] before its build)."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def place_weight(layer: Any, attribute: str, position: int, variable: Any) -> None:
    """``variable`` in the place of ``layer``'s own trainable weight number ``position``, held as ``attribute``: in
    its list, as the attribute its call reads, and as TensorFlow's dependency of that name (whose old variable is
    then no longer held by the layer, and freed)."""
    layer._trainable_variables[position] = variable
    object.__setattr__(layer, attribute, variable)
    names = getattr(layer, "_self_unconditional_dependency_names", None)
    if names is not None and attribute in names:  # TensorFlow's trackable (Keras's refuses new state: not through it)
        from tensorflow.python.trackable.base import TrackableReference

        dict.__setitem__(names, attribute, variable)  # a Keras TrackedDict: past its tracking too
        references = layer._self_unconditional_checkpoint_dependencies
        for i, reference in enumerate(references):
            if reference.name == attribute:
                references[i] = TrackableReference(attribute, variable)


def set_for_call(layer: Any, attribute: str, value: Any) -> None:
    """``layer.<attribute>`` set to ``value`` (a tensor standing in for a weight during one call), untracked."""
    object.__setattr__(layer, attribute, value)


def weight_in_place(layer: Any, position: int) -> Any:
    return layer._trainable_variables[position]


def replace_call(layer: Any, call: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """``layer`` calls ``call`` instead of its own ``call`` (returned)."""
    own = layer.call
    object.__setattr__(layer, "call", call)
    return own
