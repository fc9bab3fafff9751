"""Helpers for Ray Datasets of preprocessed rows (the streamed path): padding and the per-epoch reshuffle."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from app.data.arrays import ID, DataFacts, Split, W, Y, nest_map, padded_with_zero_weight, x_columns, zero_weight_padding

if TYPE_CHECKING:
    import ray.data


def padded(val: "ray.data.Dataset", rows: int, num_workers: int, facts: DataFacts) -> "ray.data.Dataset":
    """Weight-0 rows up to a multiple of the worker count: equal eval batches on every worker."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    pad = zero_weight_padding(rows, num_workers)
    if not pad:
        return val
    one = Split(facts.zeros(1), np.zeros(1, facts.label_dtype), np.zeros(1, np.int64))
    x, y, ids, w = (nest_map(lambda a: a[1:], a) for a in padded_with_zero_weight(one, pad + 1))
    table = pa.table({**{k: ArrowTensorArray.from_numpy(a) for k, a in x_columns(x).items()}, Y: pa.array(y),
                      ID: pa.array(ids), W: pa.array(w)})
    return val.union(ray.data.from_arrow(table))


def shuffled_each_epoch(ds: "ray.data.Dataset", seed: int) -> "ray.data.Dataset":
    """A global shuffle that Ray Data re-runs, with a new derived seed, every epoch.

    ``reseed_after_execution=True`` combines the seed with Ray Data's execution
    index, so epoch k's order is reproducible from ``seed`` and differs from
    epoch k-1's.
    """
    from ray.data import RandomSeedConfig

    return ds.random_shuffle(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))
