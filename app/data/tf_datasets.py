"""A data function's ``tf.data.Dataset`` -> the arrays it yields, read once by the driver.

How it is split across workers: materialised. The driver iterates the
dataset once (its ``map``, ``filter``, decoding and all), keeps the elements as
arrays, and from there they are in-memory data like any other: a seeded
permutation every epoch of which each worker takes its slice, so every element
is seen exactly once per epoch, every worker runs the same number of steps and
the remainder is reported, by construction. Sharding the pipeline itself on
every worker (``ds.shard(world, rank)``) would keep its per-epoch randomness
but cannot promise equal steps (a ``filter`` changes the counts per shard) and
costs one pass of the whole input per worker per epoch. The cost of
materialising: the elements must fit in memory (``MAX_BYTES``; beyond, one line
names files or a ``ray.data.Dataset``), and random augmentation in the
pipeline is drawn once, not every epoch.

A batched dataset is unbatched first and re-batched to the run's per-replica
batch; an infinite one (``repeat()``) has no epochs to split and is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.errors import UserError

MAX_BYTES = 4 << 30  # what the driver holds (and puts in Ray's object store) at most
CHUNK = 4096  # elements per read


def is_tf_dataset(value: Any) -> bool:
    """A tf.data.Dataset, told without importing TensorFlow."""
    return any(c.__name__ == "DatasetV2" and c.__module__.startswith("tensorflow") for c in type(value).__mro__)


def looks_batched(spec: Any) -> bool:
    """Whether elements are batches: a leading unknown dimension (``batch()``), or, with ``drop_remainder``,
    one leading size shared by every part while no label is a scalar (one label per element is a scalar)."""
    import tensorflow as tf

    flat = tf.nest.flatten(spec)
    if any(s.shape.rank and s.shape[0] is None for s in flat):
        return True
    if any(s.shape.rank == 0 for s in tf.nest.flatten(spec[1])):
        return False
    return all(s.shape.rank for s in flat) and len({s.shape[0] for s in flat}) == 1


def materialise(ds: Any, what: str) -> tuple:
    """(x, y[, sample_weight]) arrays from the dataset's elements, as a data function's arrays."""
    import tensorflow as tf

    if ds.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise UserError(f"{what} returned an infinite tf.data.Dataset (repeat()): this product makes the epochs "
                        "(every element once per epoch across the workers); drop .repeat()")
    spec = ds.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):  # (checked before looks_batched reads spec[1])
        raise UserError(f"{what} returned a tf.data.Dataset of {_structure(spec)}; expected elements (x, y) or "
                        "(x, y, sample_weight), x and y arrays or dicts of arrays")
    if looks_batched(spec):
        ds = ds.unbatch()
    chunks, size = [], 0
    try:
        for chunk in ds.batch(CHUNK).as_numpy_iterator():
            chunks.append(chunk)
            size += sum(a.nbytes for a in tf.nest.flatten(chunk))
            if size > MAX_BYTES:
                raise UserError(f"{what}'s tf.data.Dataset holds more than {MAX_BYTES >> 30} GiB, which the driver "
                                "reads into memory: give the data as files (parquet, TFRecord: --dataset DIR, "
                                "streamed) or as a ray.data.Dataset")
    except tf.errors.OpError as e:  # the pipeline's own error (parts batched differently, a failed map, a file)
        message = " ".join(e.message.split("[Op:")[0].split("}}")[-1].split())
        raise UserError(f"{what}'s tf.data.Dataset failed when read: {message}") from None
    if not chunks:
        raise UserError(f"{what} returned an empty tf.data.Dataset")
    return tuple(tf.nest.map_structure(lambda *parts: np.concatenate(parts), *chunks))


def _structure(spec: Any) -> str:
    import tensorflow as tf

    return str(tf.nest.map_structure(lambda s: f"{s.dtype.name}{list(s.shape)}", spec))
