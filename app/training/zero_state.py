"""A checkpoint's optimizer state when the optimizers are sharded (app.training.zero), or the weights with them
(stage 3: app.training.zero_weights, through ``ShardedState``): the unsharded state, one file per variable and slot,
so that no process ever holds it whole.

Rank 0 writes it one bucket at a time as every worker gathers the parts (its memory: one bucket more, not the
whole state), into a directory of its own that the checkpoint then takes. Any run reads it back: a sharded worker
only its own pieces of each file (memory-mapped), an unsharded optimizer (a resume on one worker, the driver's copy
of the trained model) each slot whole, into the slots it noted as it built them (``track``).

Inside a checkpoint directory::

    optimizer_state/<the optimizer's index>/<the variable's index>--<slot name>.npy
    optimizer_state/<the optimizer's index>/others.npz   # its variables that are no slot, in order (arr_0, ...)
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from app.internals import layers as layer_internals
from app.training import zero, zero_weights

DIRECTORY = "optimizer_state"

# id(optimizer) -> (its slots by (id(variable), slot name), those variables by id): unsharded optimizers, noted as
# they build (the worker's and the driver's copy of the model live as long as the process's run).
_TRACKED: dict[int, tuple[dict, dict]] = {}


def track(optimizer) -> None:
    """Note the slots an unsharded optimizer makes as it builds (call it before it is built)."""
    slots: dict = {}
    references: dict = {}
    zero.record_slots(getattr(optimizer, "inner_optimizer", optimizer), slots, references)
    _TRACKED[id(optimizer)] = (slots, references)


def _file(root: Path, index: int, variable: int, name: str) -> Path:
    """By the variable's place in the list the optimizer updates (the same list in every process that builds the
    model: a variable's path is not, Keras numbers its layers per process)."""
    return root / str(index) / f"{variable}--{name}.npy"


def gather(sharded: Sequence[zero.ShardedOptimizer], rank: int) -> Optional[Path]:
    """Every worker: the sharded optimizers' whole state gathered; rank 0 writes it into a new temporary directory,
    which it returns (the others: None)."""
    root = Path(tempfile.mkdtemp(prefix="optimizer-state-")) if rank == 0 else None
    for s in sharded:
        place = {id(v): i for i, v in enumerate(s.references or [])}  # none: never applied (compile()'s default)
        for variable, name, values in s.whole_state():
            if root is not None:
                path = _file(root, s.index, place[id(variable)], name)
                path.parent.mkdir(parents=True, exist_ok=True)
                np.save(path, values.reshape(variable.shape))
        if root is not None:
            (root / str(s.index)).mkdir(parents=True, exist_ok=True)
            np.savez(root / str(s.index) / "others.npz", *s.other_values())
    return root


def written(directory: str | Path) -> bool:
    return (Path(directory) / DIRECTORY).is_dir()


def read(directory: str | Path, optimizers: list, sharded: Sequence[zero.ShardedOptimizer]) -> None:
    """Every optimizer's state from a checkpoint ``gather`` wrote: each sharded one keeps its part, each other one
    (``track``ed) takes it whole."""
    root = Path(directory) / DIRECTORY
    by_index = {s.index: s for s in sharded}
    for i, optimizer in enumerate(optimizers):
        with np.load(root / str(i) / "others.npz") as stored:
            others = [stored[f"arr_{j}"] for j in range(len(stored.files))]
        if i in by_index:
            place = {id(v): k for k, v in enumerate(by_index[i].references)}
            by_index[i].take(lambda variable, name, i=i, place=place: _slot(root, i, place[id(variable)], variable,
                                                                              name, mapped=True), others)
            continue
        slots, references = _TRACKED[id(optimizer)]
        place = {ref: k for k, ref in enumerate(references)}  # the order it built them: the list it updates
        for (ref, name), slot in slots.items():
            slot.assign(_slot(root, i, place[ref], references[ref], name).reshape(slot.shape))
        kept = [v for v in zero.variables_of(optimizer) if all(v is not s for s in slots.values())]
        if len(kept) != len(others):
            raise ValueError(f"the checkpoint's optimizer {i} holds {len(others)} variables besides its slots, "
                             f"{optimizer.name} {len(kept)}: another optimizer")
        for v, value in zip(kept, others):
            v.assign(value)


def _slot(root: Path, index: int, place: int, variable: Any, name: str, mapped: bool = False) -> np.ndarray:
    path = _file(root, index, place, name)
    values = np.load(path, mmap_mode="r" if mapped else None) if path.exists() else None
    if values is None or tuple(values.shape) != tuple(variable.shape):
        raise ValueError(f"the checkpoint holds no {name} of shape {tuple(variable.shape)} for variable {place} "
                         f"({variable.path}) of optimizer {index}: it was written for another model")
    return values.reshape(-1)


class ShardedState:
    """One optimizer of a stage-3 model, as app.training.zero_state and the checkpoint read and write a sharded
    optimizer's state: each slot of a part gathered whole, and each worker's part taken from a whole one."""

    def __init__(self, optimizer, weights: zero_weights.ShardedWeights, index: int):
        self.optimizer, self.weights, self.index = optimizer, weights, index
        self.inner = getattr(optimizer, "inner_optimizer", optimizer)
        self.template = copy.deepcopy(optimizer)  # unbuilt: an unsharded twin reads an unsharded checkpoint
        self.slots: dict[tuple[int, str], Any] = {}
        zero.record_slots(self.inner, self.slots)

    @property
    def variables(self) -> list:
        """The variables it updates (none before its first step)."""
        return layer_internals.optimizer_variables(self.inner)

    @property
    def references(self) -> list:
        return [self.weights.spec(v) for v in self.variables]

    @property
    def parts(self) -> list:
        return [v for v in self.variables if zero_weights.is_shard(v)]

    def _own_variables(self) -> tuple[list, list]:
        """(each slot as (the variable it follows, slot name, slot), the optimizer's other variables)."""
        by_id = {id(v): v for v in self.variables}
        slot_ids = {id(slot) for slot in self.slots.values()}
        slots = [(by_id[ref], name, slot) for (ref, name), slot in self.slots.items() if ref in by_id]
        return slots, [v for v in zero.variables_of(self.optimizer) if id(v) not in slot_ids]

    def whole_state(self) -> Iterator[tuple[Any, str, np.ndarray]]:
        """Every worker, the same calls in the same order: (the whole weight, slot name, its flat values)."""
        import tensorflow as tf

        for variable, name, slot in self._own_variables()[0]:
            spec = self.weights.spec(variable)
            if zero_weights.is_shard(variable):
                values = np.asarray(self.weights.collective.gather_tensor(tf.convert_to_tensor(slot)))[:spec.length]
            else:
                values = np.ravel(slot.numpy())
            yield spec, name, values

    def other_values(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in self._own_variables()[1]]

    def take(self, slot_of: Callable[[Any, str], np.ndarray], other_values: list) -> None:
        """This worker's part of a whole state: ``slot_of(the whole weight, slot name)`` its flat values."""
        slots, others = self._own_variables()
        if len(other_values) != len(others):
            raise ValueError(f"the checkpoint's {self.optimizer.name} holds {len(other_values)} variables besides its "
                             f"slots, this one {len(others)}: another optimizer")
        rank = self.weights.collective.rank
        for variable, name, slot in slots:
            spec = self.weights.spec(variable)
            values = slot_of(spec, name)
            slot.assign(spec.mine(values, rank) if zero_weights.is_shard(variable) else np.reshape(values, slot.shape))
        for v, value in zip(others, other_values):
            v.assign(value)

    def twin(self) -> zero.Twin:
        """An unsharded copy of the optimizer built on the model's whole weights (inside ``ShardedWeights.whole``)."""
        twin = zero.Twin.of(self.template)
        if self.variables:
            twin.optimizer.build([self._in_place(v) for v in self.variables])
        return twin

    def _in_place(self, variable) -> Any:
        """The variable that stands in ``variable``'s place in its layer now (the whole one, inside ``whole``)."""
        spec = self.weights.spec(variable)
        if isinstance(spec, zero_weights.Shard):
            return layer_internals.weight_in_place(spec.layer, spec.position)
        return variable

    def take_from(self, twin: zero.Twin) -> None:
        """This worker's part of the whole state an unsharded copy holds (read from an unsharded checkpoint)."""
        standing = {id(self.weights.spec(v)): self._in_place(v) for v in self.variables}
        kept = [v for v in zero.variables_of(twin.optimizer) if all(v is not s for s in twin.slots.values())]
        self.take(lambda spec, name: np.ravel(twin.slots[(id(standing[id(spec)]), name)].numpy()),
                  [v.numpy() for v in kept])
