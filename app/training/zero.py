"""Optimizer state sharded over the workers (ZeRO stages 1 and 2), inside Keras's own fit.

Data parallel keeps the whole optimizer state on every worker (Adam: two moments, twice the weights). Sharded,
each of N workers keeps 1/N of it:

- the variables an optimizer updates are cut, in their order, into buckets of about ``BYTES_PER_PACK`` (one dtype
  each), and each bucket's flat vector into N equal parts (zeros pad the last): the cut is even whatever the
  layer sizes, and one part may hold pieces of several variables;
- the optimizer (the user's own object, any elementwise Keras optimizer) is built on this worker's parts, one
  flat variable per bucket, so its slots (Adam's moments, SGD's momentum, the accumulators of
  ``gradient_accumulation_steps``) are 1/N of the unsharded ones;
- a step: each worker's gradients, weighed by its rows, are reduce-scattered over the workers in buckets (each
  worker gets only its part, summed) and divided by the global batch's rows (one scalar all-reduce); its part
  of the current weights is copied into its flat variables; the optimizer updates them (clipping by a variable's
  norm or the global norm from the squares summed over every part); the updated parts are gathered from every
  worker into every variable (an all-gather of the weights), and the variables' constraints applied, as Keras
  applies them.

Stages: a worker only ever holds its part of the summed gradients and of any accumulator, which is stage 2; stage
1 asks for less and gets the same. The reduce-scatter is TensorFlow's all-to-all of the parts, summed where they
arrive (``CollectiveReduceScatterV2`` has only NCCL's implementation in TensorFlow 2.21; its all-to-all runs on
CPUs and moves the same bytes). A step's bytes on the wire are a reduce-scatter of the gradients plus an all-gather
of the weights: an unsharded step's all-reduce is the same two halves.

An update is the same, element by element, as the unsharded one for an optimizer whose update of an element reads
only that element's gradient and state (``ELEMENTWISE``). Others (Adafactor's factored moments, Lamb's and Muon's
per-matrix steps) are refused, as are weight-decay exclusions (a part mixes variables). A variable that never gets
a gradient stays as it is under these optimizers (zero gradient, zero state) unless weight decay is on.

Checkpoints hold the unsharded state, one file per variable and slot (app.training.zero_state), gathered and written
one bucket at a time; a run resumes sharded or not, at any worker count. A sharded run resumed from an unsharded
checkpoint reads it into an unbuilt copy of the optimizer (deep-copied when the run started) built on the model's
variables, and each worker keeps its part.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from app import internals
from app.errors import UserError
from app.training.collective import BYTES_PER_PACK, Collective, Site, cut_in_packs

STAGES = (1, 2, 3)  # 3: the weights too (app.training.zero_weights)
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")
IN_FLIGHT = 4  # buckets whose collectives a step runs at once (their transient buffers: ~4 x 4 MiB x 3)


def check(optimizers: list, stage: int) -> None:
    """What cannot be sharded, in one line before any worker starts."""
    if stage not in (0, *STAGES):
        raise UserError(f"shard_optimizer must be 1, 2 or 3 (ZeRO's stage; 0: off), got {stage!r}")
    if not stage:
        return
    if not optimizers:
        raise UserError("shard_optimizer cuts a compiled optimizer's state over the workers: this model holds no "
                        "Keras optimizer (compile it with one)")
    for optimizer in optimizers:
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        kind = type(inner).__name__
        if not any(c.__name__ in ELEMENTWISE and c.__module__.startswith("keras") for c in type(inner).__mro__):
            raise UserError(f"shard_optimizer: {kind}'s update of a weight reads more than that weight's own "
                            f"gradient and state, so its state cannot be cut into flat parts; shardable: "
                            f"{', '.join(ELEMENTWISE)} (or leave shard_optimizer out)")
        # At stage 3 a part is one variable's, under its name: a pattern of names still finds it, a variable not.
        if (getattr(inner, "_exclude_from_weight_decay", None) if stage == 3 else
                internals.weight_decay_exclusions(inner)):
            raise UserError(f"shard_optimizer: {kind}.exclude_from_weight_decay names variables, and a worker's "
                            + ("part is a variable of its own: name them by pattern (var_names=) instead"
                               if stage == 3 else "part mixes pieces of several variables: leave the exclusions or "
                               "shard_optimizer out"))


@dataclass(frozen=True)
class Sharding:
    """What a run shards: ``stage`` (0: nothing) and the plan's lines."""

    stage: int
    lines: list[str]


def sharding(model, optimizers: list, stage: int, world: int) -> Sharding:
    """The run's sharding, checked (``model``: the driver's copy; ``optimizers``: those it holds, unbuilt)."""
    check(optimizers, stage)
    if not stage:
        return Sharding(0, [])
    if world == 1:
        return Sharding(0, [f"shard_optimizer {stage}: one worker, nothing to shard: it trains unsharded"])
    if stage == 3:  # its plan: app.training.zero_memory, which the run asks
        return Sharding(stage, [])
    sizes = ""
    # The bytes result.json's optimizer_state_bytes will give, unsharded and sharded; a subclassed model's copy here
    # is not built yet (its variables are made at its first call, on the workers): no sizes then.
    if len(optimizers) == 1 and model.built and model.trainable_variables:
        variables = model.trainable_variables
        dtypes = [str(v.dtype) for v in variables]
        lengths = [int(np.prod(v.shape)) for v in variables]
        parts = sum(b.part for b in cut(lengths, [np.dtype(_numpy_dtype(d)).itemsize for d in dtypes], dtypes, world))
        slots, counters = _slots_and_counters(optimizers[0])
        whole, mine = slots * sum(lengths) * 4 + counters, slots * parts * 4 + counters
        sizes = f" ({_mb(mine)} of {_mb(whole)} a worker)"
    stage_1 = "; stage 1 asked: the summed gradients are cut too, at no cost" if stage == 1 else ""
    return Sharding(stage, [
        f"shard_optimizer {stage} (ZeRO): each of the {world} workers keeps 1/{world} of every optimizer's state"
        f"{sizes}, on its flat part of the weights; a step reduce-scatters the gradients (each worker gets its part, "
        f"summed){stage_1}, then gathers the updated parts (an all-gather of the weights): an all-reduce's bytes; "
        "checkpoints hold the whole state (result.json: optimizer_state_bytes)"])


def _slots_and_counters(optimizer) -> tuple[int, int]:
    """The slots ``optimizer`` keeps per float32 weight and the bytes of its other variables (its counters),
    counted on a copy built on one weight."""
    import keras

    twin = Twin.of(optimizer)
    twin.optimizer.build([keras.Variable(np.zeros(1, "float32"), name="probe")])
    others = [v for v in variables_of(twin.optimizer) if all(v is not s for s in twin.slots.values())]
    return len(twin.slots), state_bytes_of(others)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def state_bytes(optimizers: list) -> int:
    """Bytes of every variable the optimizers hold on this worker (their state: slots, step counters, scales)."""
    return state_bytes_of(list({id(v): v for optimizer in optimizers for v in variables_of(optimizer)}.values()))


def state_bytes_of(variables: list) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(_numpy_dtype(str(v.dtype))).itemsize for v in variables)


def _numpy_dtype(dtype: str) -> str:
    return "float16" if dtype == "bfloat16" else dtype  # the same two bytes


@dataclass(frozen=True)
class Bucket:
    """Consecutive variables of one dtype, flat, cut into ``world`` parts of ``part`` elements."""

    members: tuple[int, ...]  # the variables' positions in the optimizer's list
    sizes: tuple[int, ...]
    part: int

    @property
    def length(self) -> int:
        return sum(self.sizes)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(member, start, stop): the pieces of the variables in ``rank``'s part, in order (start and stop within
        that variable's flat values)."""
        lo, hi = rank * self.part, (rank + 1) * self.part
        out, at = [], 0
        for j, size in enumerate(self.sizes):
            a, b = max(lo, at), min(hi, at + size)
            if a < b:
                out.append((j, a - at, b - at))
            at += size
        return out


def cut(sizes: list[int], itemsizes: list[int], dtypes: list[str], world: int,
        bytes_per_bucket: int = BYTES_PER_PACK) -> list[Bucket]:
    """The buckets of variables of these sizes."""
    groups = cut_in_packs([n * item for n, item in zip(sizes, itemsizes)], bytes_per_bucket, dtypes)
    return [Bucket(tuple(g), tuple(sizes[i] for i in g), max(1, math.ceil(sum(sizes[i] for i in g) / world)))
            for g in groups]


def record_slots(optimizer, slots: dict[tuple[int, str], Any], references: Optional[dict[int, Any]] = None) -> None:
    """Have ``optimizer`` note each slot it makes: (id of the variable it follows, slot name) -> the slot (and, in
    ``references``, that id -> the variable)."""
    own = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        slot = own(reference_variable, name=name, initializer=initializer)
        slots[(id(reference_variable), name or "var")] = slot
        if references is not None:
            references[id(reference_variable)] = reference_variable
        return slot

    optimizer.add_variable_from_reference = add_variable_from_reference


@dataclass
class Twin:
    """An unsharded copy of an optimizer, built on the model's variables: the checkpoint's layout."""

    optimizer: Any
    slots: dict[tuple[int, str], Any]

    @classmethod
    def of(cls, optimizer) -> "Twin":
        """A deep copy of an unbuilt ``optimizer`` that notes its slots as it builds."""
        twin = cls(copy.deepcopy(optimizer), {})
        record_slots(getattr(twin.optimizer, "inner_optimizer", twin.optimizer), twin.slots)
        return twin


class ShardedOptimizer:
    """One optimizer of the model, its state cut over the workers (see the module docstring)."""

    def __init__(self, optimizer, collective: Collective, index: int, rows: Any):
        """``rows.value``: the rows of the step being traced (app.training.keras_sync)."""
        self.optimizer, self.collective, self.index, self.rows = optimizer, collective, index, rows
        self.inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own
        self.template = copy.deepcopy(optimizer)  # unbuilt: the unsharded layout, for checkpoints
        self.references: Optional[list] = None  # the variables it updates (its first apply's)
        self.buckets: list[Bucket] = []
        self.parts: list = []  # this worker's flat variables, one per bucket
        self.slots: dict[tuple[int, str], Any] = {}
        record_slots(self.inner, self.slots)
        self._own_apply, self._own_clip = optimizer.apply, internals.own_clip_gradients(self.inner)
        optimizer.apply = self.apply
        internals.replace_clip_gradients(self.inner, self.clip)

    # --- the step ------------------------------------------------------------------------------------------------

    def _build(self, variables: list) -> None:
        import keras
        import tensorflow as tf

        if any(getattr(v, "overwrite_with_gradient", False) for v in variables):
            raise UserError("shard_optimizer: a variable with overwrite_with_gradient (float8 training) takes its "
                            "gradient as its value, not an update: leave shard_optimizer out")
        self.references = list(variables)
        dtypes = [str(v.dtype) for v in variables]
        self.buckets = cut([int(np.prod(v.shape)) for v in variables],
                           [np.dtype(_numpy_dtype(d)).itemsize for d in dtypes], dtypes, self.collective.world)
        with tf.init_scope():  # made once, outside the step being traced
            self.parts = [keras.Variable(initializer="zeros", shape=(b.part,), dtype=dtypes[b.members[0]],
                                         name=f"shard_{self.index}_{k}") for k, b in enumerate(self.buckets)]
            self.optimizer.build(self.parts)

    def apply(self, grads, trainable_variables=None):
        import tensorflow as tf

        if trainable_variables is None:
            raise UserError("shard_optimizer: the model's step calls optimizer.apply(grads) without its variables: "
                            "pass them, optimizer.apply(grads, variables), as Keras's own train_step does")
        variables = list(trainable_variables)
        if self.references is None:
            self._build(variables)
        elif [id(v) for v in variables] != [id(v) for v in self.references]:
            raise UserError(f"shard_optimizer: {self.optimizer.name} updates other variables than at its first "
                            "step; a sharded optimizer updates one fixed list")
        world, rank = self.collective.world, self.collective.rank
        n = self.rows.value
        # IN_FLIGHT buckets at a time, each waiting for the one IN_FLIGHT before it: a bucket's summed gradients
        # (and, below, its gathered weights) are freed before later ones are made, so the step's transient memory
        # is a few buckets', not the model's (the executor would otherwise run every all-reduce, or every gather,
        # before any slice), while a few collectives still overlap.
        scaled = hasattr(self.optimizer, "inner_optimizer")  # a LossScaleOptimizer: its step may be skipped
        total = self.collective.in_graph(n, Site.ROWS + self.index)  # the global batch's rows
        summed_parts, bad, done = [], [], []
        for k, b in enumerate(self.buckets):
            with tf.control_dependencies(done[k - IN_FLIGHT] if k >= IN_FLIGHT else []):
                flat = [tf.zeros([size]) if grads[i] is None else
                        tf.reshape(tf.cast(tf.convert_to_tensor(grads[i]), tf.float32), [-1]) * n
                        for i, size in zip(b.members, b.sizes)]
                flat.append(tf.zeros([b.part * world - b.length]))  # zeros: the padding sums to zeros
                # One row per worker, its part: each worker gets its part summed over the workers.
                summed = self.collective.scatter_sum_in_graph(tf.reshape(tf.concat(flat, 0), [world, b.part]),
                                                              Site.GRADIENTS + self.index * Site.PACKS + k)
            bad += [tf.reduce_sum(tf.cast(~tf.math.is_finite(summed), tf.float32))] if scaled else []
            summed_parts.append(summed)
            done.append([summed])
        part_grads = [summed / total for summed in summed_parts]
        if scaled:  # a loss scale overflowed on one worker overflows on all: an inf in any part skips every step
            poison = tf.where(self.collective.in_graph(tf.add_n(bad), Site.FINITE + self.index) > 0, float("nan"), 0.0)
            part_grads = [g + poison for g in part_grads]
        part_grads = [tf.cast(g, part.dtype) for g, part in zip(part_grads, self.parts)]
        for k in range(len(self.buckets)):
            self.parts[k].assign(self._part_of(k, variables, rank))
        self._own_apply(part_grads, self.parts)
        done = []
        for k, b in enumerate(self.buckets):
            with tf.control_dependencies(done[k - IN_FLIGHT] if k >= IN_FLIGHT else []):
                whole = self.collective.gather_in_graph(tf.convert_to_tensor(self.parts[k]),
                                                        Site.PARTS + self.index * Site.PACKS + k)
                padding = b.part * world - b.length
                for i, piece in zip(b.members, tf.split(whole, [*b.sizes, padding] if padding else list(b.sizes))):
                    v = variables[i]
                    v.assign(tf.reshape(piece, v.shape))
                    if v.constraint is not None:  # as Keras applies them, after the update
                        v.assign(v.constraint(v))
            # Reads of the variables just written: ordered after their assigns (the same resource), they hold the
            # gather IN_FLIGHT buckets later back until this one's is in place.
            done.append([tf.convert_to_tensor(variables[i]) for i in b.members])

    def _part_of(self, k: int, variables: list, rank: int):
        """``rank``'s part of bucket ``k`` of ``variables``' values (zeros past their end)."""
        import tensorflow as tf

        b = self.buckets[k]
        pieces = [tf.reshape(tf.convert_to_tensor(variables[b.members[j]]), [-1])[a:z] for j, a, z in b.pieces(rank)]
        filled = sum(z - a for _, a, z in b.pieces(rank))
        return tf.concat([*pieces, tf.zeros([b.part - filled], self.parts[k].dtype)], 0)

    def clip(self, grads: list) -> list:
        """Keras's clipping of the parts' gradients: by each variable's norm, or the global norm, from the squares
        summed over every part; by value, element by element, as Keras does."""
        import tensorflow as tf

        clipnorm, global_clipnorm = self.inner.clipnorm, self.inner.global_clipnorm
        if not (clipnorm and clipnorm > 0) and not (global_clipnorm and global_clipnorm > 0):
            return self._own_clip(grads)
        rank = self.collective.rank
        squares: list[list] = [[] for _ in self.references]
        for b, g in zip(self.buckets, grads):
            at = 0
            for j, a, z in b.pieces(rank):
                squares[b.members[j]].append(tf.reduce_sum(tf.square(tf.cast(g[at:at + z - a], tf.float32))))
                at += z - a
        local = tf.stack([tf.add_n(s) if s else tf.constant(0.0) for s in squares])
        norms = tf.sqrt(self.collective.in_graph(local, Site.NORMS + self.index))
        if clipnorm and clipnorm > 0:  # Keras's _clip_by_norm: g x c / max(norm, c), per variable
            factor = clipnorm / tf.maximum(norms, clipnorm)
            out = []
            for b, g in zip(self.buckets, grads):
                scale = [tf.fill([z - a], factor[b.members[j]]) for j, a, z in b.pieces(rank)]
                filled = sum(z - a for _, a, z in b.pieces(rank))
                out.append(g * tf.cast(tf.concat([*scale, tf.ones([b.part - filled])], 0), g.dtype))
            return out
        # Keras's clip_by_global_norm (a NaN where the norm is not finite)
        norm = tf.sqrt(tf.reduce_sum(tf.square(norms)))
        scale = global_clipnorm * tf.minimum(1.0 / norm, 1.0 / global_clipnorm) + (norm - norm)
        return [g * tf.cast(scale, g.dtype) for g in grads]

    # --- checkpoints: the unsharded state ---------------------------------------------------------------------

    def twin(self) -> Twin:
        """An unsharded copy of the optimizer built on the model's variables (its whole state, in this process)."""
        twin = Twin.of(self.template)
        if self.references is not None:  # else never applied (compile()'s default beside a model's own optimizers)
            twin.optimizer.build(self.references)
        return twin

    def _own_variables(self) -> tuple[list, list]:
        """(this optimizer's slots as (bucket, slot name, variable), its other variables), in a fixed order."""
        bucket_of = {id(p): k for k, p in enumerate(self.parts)}
        slot_ids = {id(v): (bucket_of[ref], name) for (ref, name), v in self.slots.items()}
        slots, others = [], []
        for v in variables_of(self.optimizer):
            (slots.append((*slot_ids[id(v)], v)) if id(v) in slot_ids else others.append(v))
        return slots, others

    def whole_state(self) -> Iterator[tuple[Any, str, np.ndarray]]:
        """Every worker, the same calls in the same order: each slot of each variable, whole, gathered from every
        worker's part: (the variable, the slot's name, its flat values), one bucket at a time."""
        import tensorflow as tf

        for k, name, v in self._own_variables()[0]:
            b = self.buckets[k]
            whole = np.asarray(self.collective.gather_tensor(tf.convert_to_tensor(v)))[:b.length]
            for i, piece in zip(b.members, np.split(whole, np.cumsum(b.sizes)[:-1])):
                yield self.references[i], name, piece

    def other_values(self) -> list[np.ndarray]:
        """The optimizer's variables that are no slot (its step count, learning rate, loss scale), in order."""
        return [np.asarray(v.numpy()) for v in self._own_variables()[1]]

    def take(self, slot_of: Callable[[Any, str], np.ndarray], other_values: list) -> None:
        """This worker's parts of a whole state: ``slot_of(variable, slot name)`` its flat values (only this
        worker's pieces are read from it), ``other_values`` as ``other_values()`` gives them."""
        slots, others = self._own_variables()
        if len(other_values) != len(others):
            raise ValueError(f"the checkpoint's {self.optimizer.name} holds {len(other_values)} variables besides its "
                             f"slots, this one {len(others)}: another optimizer")
        for k, name, v in slots:
            b = self.buckets[k]
            mine, at = np.zeros(b.part, np.asarray(v.numpy()).dtype), 0
            for j, a, z in b.pieces(self.collective.rank):
                mine[at:at + z - a] = slot_of(self.references[b.members[j]], name)[a:z]
                at += z - a
            v.assign(mine)
        for v, value in zip(others, other_values):
            v.assign(value)

    def take_from(self, twin: Twin) -> None:
        """This worker's parts of the whole state an unsharded copy holds (read from an unsharded checkpoint)."""
        kept = [v for v in variables_of(twin.optimizer) if all(v is not s for s in twin.slots.values())]
        self.take(lambda ref, name: np.ravel(twin.slots[(id(ref), name)].numpy()), [v.numpy() for v in kept])


def variables_of(optimizer) -> list:
    """An optimizer's variables and its inner optimizer's (a LossScaleOptimizer), each once, in order."""
    seen: dict[int, Any] = {}
    for v in [*optimizer.variables, *getattr(optimizer, "inner_optimizer", optimizer).variables]:
        seen.setdefault(id(v), v)
    return list(seen.values())
