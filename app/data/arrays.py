"""In-memory data: the split arrays, what the workers need to know about them, and the one padding helper.

Every row carries an integer ``id`` (its index in the source) so that the
"every sample exactly once per epoch" rule can be audited, and validation
rows carry a weight ``w`` so that padding rows (added to give every worker the
same number of evaluation batches) count for nothing. The same column names
are used by Ray Datasets and by the tf.data input on the workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from app.errors import UserError

X, Y, ID, W = "x", "y", "id", "w"
Task = Literal["classification", "binary", "regression"]


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # float32, (n, *feature_shape)
    y: np.ndarray  # int64 class ids, or float32 targets (regression)
    ids: np.ndarray  # int64, (n,)

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class DataFacts:
    """What the model and every worker need to know about the data (not the data itself)."""

    feature_shape: tuple[int, ...]
    task: Task
    num_classes: Optional[int]  # None for regression
    num_train_rows: int
    num_val_rows: int
    # Rows that are flattened images (the built-in digits): the image shape, for models that want one.
    image_shape: Optional[tuple[int, ...]] = None

    @property
    def label_dtype(self) -> str:
        return "float32" if self.task == "regression" else "int64"


@dataclass(frozen=True)
class Source:
    """Train and validation arrays in memory, and their facts."""

    train: Split
    val: Split
    facts: DataFacts
    streamed = False  # app.data.streamed.Streamed: True; read where the input path differs


def split_holdout(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[Split, Split]:
    """A seeded train/val split; ids are row indices in the source."""
    ids = np.arange(len(y), dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    if n_val == 0 or n_val == len(y):
        raise UserError(f"val_fraction={val_fraction} leaves an empty train or val set for {len(y)} rows")
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    return (
        Split(x[train_idx], y[train_idx], ids[train_idx]),
        Split(x[val_idx], y[val_idx], ids[val_idx]),
    )


def split_last(x: np.ndarray, y: np.ndarray, fraction: float) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                       tuple[np.ndarray, np.ndarray]]:
    """Keras's ``validation_split``: the last ``fraction`` of the rows, in their given order, are validation.

    The cut is Keras's own (``floor(n * (1 - fraction))``), so a script moved from ``model.fit`` validates
    on the same rows. The two parts go to the source as explicit train and val arrays (memory.arrays_from).
    """
    n = len(y)
    split_at = int(np.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise UserError(f"validation_split={fraction} leaves an empty train or val set for {n} rows")
    return (x[:split_at], y[:split_at]), (x[split_at:], y[split_at:])


def zero_weight_padding(n: int, multiple: int) -> int:
    """How many weight-0 rows make ``n`` divisible by ``multiple``."""
    return (-n) % multiple


def padded_with_zero_weight(split: Split, multiple: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, ids, weights) with weight-0 copies of the first row appended until the count divides by ``multiple``.

    Padding rows have id -1 and weigh nothing in the loss and metric sums; they
    exist so that every worker or replica gets the same number of eval batches.
    """
    x, y, ids = split.x, split.y, split.ids
    w = np.ones(len(y), dtype=np.float32)
    pad = zero_weight_padding(len(y), multiple)
    if pad:
        x = np.concatenate([x, np.repeat(x[:1], pad, axis=0)])
        y = np.concatenate([y, np.repeat(y[:1], pad)])
        ids = np.concatenate([ids, np.full(pad, -1, dtype=np.int64)])
        w = np.concatenate([w, np.zeros(pad, dtype=np.float32)])
    return x, y, ids, w
