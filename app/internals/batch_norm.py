"""Keras's private API for a batch-norm layer's moments (app.training.sync_batch_norm), behind the same door as
app.internals: the only place app/ touches these names, checked against the installed Keras by
tests/test_internals.py. A leaf: libraries imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Callable

# BatchNormalization computes a training batch's mean and variance in ``_moments(inputs, mask)`` over the axes
# ``_reduction_axes`` (keras/src/layers/normalization/batch_normalization.py); with synchronized=True, Keras's
# ``ops.moments`` sums them with the replica context's all-reduce, which on a worker of this product (the default
# strategy: app.training.collective) sums nothing. Keras publishes no hook for a layer's moments.


def replace_moments(layer: Any, moments: Callable[[Callable[[Any, Any], Any], Any, Any], Any]) -> None:
    """``layer`` computes its batch's moments by ``moments(its own way, inputs, mask)``."""
    own = layer._moments
    object.__setattr__(layer, "_moments", lambda inputs, mask: moments(own, inputs, mask))


def reduction_axes(layer: Any) -> list[int]:
    """The axes a batch-norm layer's moments sum over (every axis but its features'), once it is built."""
    return list(layer._reduction_axes)
