"""What a worker holds of a model at each of ZeRO's stages, decided in the driver before anything starts: which
layers gather their weights at stage 3 (and why the others stay whole), the parts each weight is cut into, and the
bytes of weights, gradients and optimizer state a worker keeps at stages 0-3 (app.training.zero_weights cuts them on
the workers; app.run.fit_checks weighs them against the memory budget)."""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import numpy as np

from app.internals import layers as layer_internals
from app.training import zero


def why_whole(layer) -> Optional[str]:
    """Why ``layer``'s own trainable weights cannot be gathered as it computes (None: they can)."""
    import keras

    own = layer_internals.own_trainable(layer)
    attributes = {id(v) for v in vars(layer).values() if isinstance(v, keras.Variable)}
    if layer_internals.keeps_state(layer):
        return "it updates state as it runs (its non-trainable variables)"
    if layer_internals.draws_random(layer):
        return "it draws random numbers as it runs"
    if any(getattr(v, "constraint", None) is not None or getattr(v, "regularizer", None) is not None for v in own):
        return "a constraint or a regularizer reads its whole weight"
    if any(id(v) not in attributes for v in own):
        return "it reads a weight that is not one of its attributes"
    if any("float" not in str(v.dtype) for v in own):
        return "a weight that is no float"
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantization"
    return None


def layers_with_weights(model) -> Iterator[Any]:
    """The model and every layer inside it that owns trainable weights, each once."""
    for layer in layer_internals.layers_of(model):
        if layer_internals.own_trainable(layer):
            yield layer


def _bytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(zero._numpy_dtype(str(v.dtype))).itemsize for v in variables)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def plan(model, world: int) -> list[str]:
    """The plan's lines: what each worker keeps of the weights, and the layers that stay whole (``model``: the
    driver's built copy; a subclassed model not built yet is cut as its workers build it)."""
    if not (model.built and model.trainable_variables):
        return [f"shard_optimizer 3 (ZeRO): each of the {world} workers keeps 1/{world} of every weight its layers "
                "gather (sizes: once its workers build it)"]
    cut, whole = [], []
    for layer in layers_with_weights(model):
        reason = why_whole(layer)
        (cut if reason is None else whole).append((layer, reason))
    total = _bytes(model.trainable_variables)
    kept = sum(_bytes(layer_internals.own_trainable(layer)) for layer, _ in whole)
    mine = kept + sum(sum(math.ceil(int(np.prod(v.shape)) / world) * np.dtype(zero._numpy_dtype(str(v.dtype))).itemsize
                          for v in layer_internals.own_trainable(layer)) for layer, _ in cut)
    largest = max((_bytes(layer_internals.own_trainable(layer)) for layer, _ in cut), default=0)
    lines = [f"shard_optimizer 3 (ZeRO): each of the {world} workers keeps 1/{world} of every weight, gradient and "
             f"optimizer slot of {len(cut)} layer(s) ({_size(mine)} of weights a worker, of {_size(total)}); each "
             f"layer's weights are gathered as it computes, forward and backward (largest {_size(largest)}), its "
             "gradients reduce-scattered; checkpoints hold the whole model"]
    if whole:
        lines.append("shard_optimizer 3: whole on every worker: " + "; ".join(
            f"{layer.name} ({_size(_bytes(layer_internals.own_trainable(layer)))}: {reason})" for layer, reason in whole))
    return lines


def part_of(shape, world: int, by_rows: bool) -> tuple[int, tuple[int, ...]]:
    """(elements, shape) of a worker's part of a weight of ``shape``: a flat 1/N, or (an embedding table, whose
    gradient holds only the rows a batch looked up) whole rows, so that its gradient's rows stay rows of the part."""
    shape = tuple(int(d) for d in shape)
    if by_rows and len(shape) > 1:
        rows, rest = math.ceil(shape[0] / world), int(np.prod(shape[1:]))
        return rows * rest, (rows, *shape[1:])
    part = max(1, math.ceil(int(np.prod(shape)) / world))
    return part, (part,)


def training_bytes(model, optimizer, world: int) -> Optional[dict[int, int]]:
    """Each worker's bytes of weights, gradients and optimizer state at each stage 0-3, for ``model`` (the driver's
    built copy) trained by ``optimizer`` on ``world`` workers; activations not counted (they depend on the batch).
    None: the model is not built yet (a subclassed model's weights are made at its first call). Stages 1 and 2
    hold the same: a worker's backward pass still makes its whole gradients before they are reduce-scattered."""
    if not (model.built and model.trainable_variables):
        return None
    slots, counters = zero._slots_and_counters(optimizer)
    weights = _bytes(model.trainable_variables)
    untrained = _bytes(model.non_trainable_variables)
    cut = [layer for layer in layers_with_weights(model) if why_whole(layer) is None]
    cut_bytes = sum(_bytes(layer_internals.own_trainable(layer)) for layer in cut)
    parts = sum(part_of(v.shape, world, False)[0] * np.dtype(zero._numpy_dtype(str(v.dtype))).itemsize
                for layer in cut for v in layer_internals.own_trainable(layer))
    largest = max((_bytes(layer_internals.own_trainable(layer)) for layer in cut), default=0)
    whole = weights - cut_bytes
    sharded_state = math.ceil(slots * weights / world)
    return {0: 2 * weights + slots * weights + untrained + counters,
            1: 2 * weights + sharded_state + untrained + counters,
            2: 2 * weights + sharded_state + untrained + counters,
            3: (2 + slots) * (parts + whole) + 2 * largest + untrained + counters}
