"""In-memory data: the split arrays, what the workers need to know about them, and the one padding helper.

Every row carries an integer ``id`` (its index in the source) so that the
"every sample exactly once per epoch" rule can be audited, and validation
rows carry a weight ``w`` so that padding rows (added to give every worker the
same number of evaluation batches) count for nothing. The same column names
are used by Ray Datasets and by the tf.data input on the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

import numpy as np

from app.errors import UserError

X, Y, ID, W = "x", "y", "id", "w"

Task = Literal["classification", "binary", "regression"]


# x and y are an array, or a dict of arrays: a model's named inputs, its named outputs' labels.
Arrays = Union[np.ndarray, dict[str, np.ndarray]]


def nest_map(fn: Callable[[np.ndarray], Any], a: Any) -> Any:
    """``fn`` on an array, or on each array of a dict of named arrays."""
    return {k: fn(v) for k, v in a.items()} if isinstance(a, dict) else fn(a)


def input_column(name: str) -> str:
    """The column of a preprocessed Ray Dataset that holds named input ``name`` (one X column without names)."""
    return f"{X}/{name}"


def x_columns(x: Arrays) -> dict[str, np.ndarray]:
    """Features as a preprocessed Ray Dataset's columns: X, or one column per named input."""
    return {input_column(k): v for k, v in x.items()} if isinstance(x, dict) else {X: x}


def x_of(batch: dict[str, np.ndarray], input_names: Optional[Any]) -> Arrays:
    """A batch of those columns back as the model's input (``input_names``: None for one input)."""
    return {k: batch[input_column(k)] for k in input_names} if input_names is not None else batch[X]


def epoch_pass(ds: Any) -> Any:
    """A worker's dataset of one epoch's batches as fit() iterates it: two batches ready ahead, and no tf.data
    autotuning, which tunes nothing here (no AUTOTUNE parameter) and whose thread the epoch's iterator waits for as
    fit() drops it at the next epoch (measured: 1.5-2 s at an epoch's start on a Ray worker, py-spy in
    ``IteratorResource::~IteratorResource`` -> ``UnboundedThreadPool`` -> ``Notification::WaitForNotification``)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.prefetch(2).with_options(options)


def first(a: Arrays) -> np.ndarray:
    return next(iter(a.values())) if isinstance(a, dict) else a


def concatenated(a: Arrays, b: Arrays) -> Arrays:
    """The rows of ``a`` then those of ``b`` (arrays, or dicts of named arrays with the same names)."""
    return {k: np.concatenate([v, b[k]]) for k, v in a.items()} if isinstance(a, dict) else np.concatenate([a, b])


@dataclass(frozen=True)
class Moments:
    """Each feature's mean and variance over the training rows, from their count, sum and sum of squares (float64):
    the same from one array as from the sums of its blocks."""

    count: int
    total: np.ndarray
    squares: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray) -> Optional["Moments"]:
        """Of rows of numbers, each feature on a scale of its own (tabular: 2-D); None for images (more axes)."""
        rows = np.asarray(x, np.float64)
        return cls(len(rows), rows.sum(axis=0), np.square(rows).sum(axis=0)) if rows.ndim == 2 and len(rows) else None

    @classmethod
    def of_fit_rows(cls, x: Any, validation_split: float) -> Optional["Moments"]:
        """Of the rows Keras's fit trains on, those its ``validation_split`` leaves; None for x not of numbers."""
        from app import internals

        rows = np.asarray(x)
        if rows.dtype.kind not in "biuf":
            return None
        return cls.of(internals.keras_validation_split((rows,), validation_split)[0][0] if validation_split else rows)

    @classmethod
    def of_targets(cls, y: Any) -> Optional["Moments"]:
        """Of a regression's targets (one per example, or several), over the rows given; None for no rows."""
        rows = np.asarray(y, np.float64)
        return cls.of(rows.reshape(len(rows), -1)) if rows.size else None

    def as_text(self) -> str:
        """Exact float64 sums as JSON text (a block's statistics table holds one string column for them)."""
        import json

        return json.dumps([self.count, self.total.tolist(), self.squares.tolist()])

    @classmethod
    def from_text(cls, text: str) -> "Moments":
        import json

        count, total, squares = json.loads(text)
        return cls(count, np.asarray(total), np.asarray(squares))

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.count + other.count, self.total + other.total, self.squares + other.squares)

    @property
    def mean(self) -> list[float]:
        return (self.total / self.count).tolist()

    @property
    def variance(self) -> list[float]:
        """A feature that never changes in the training rows keeps its scale (variance 1), as scikit-learn's
        StandardScaler keeps it: a later value is not divided by Keras's epsilon."""
        mean = self.total / self.count
        variance = np.maximum(self.squares / self.count - np.square(mean), 0.0)
        return np.where(variance > 1e-12 * np.maximum(np.square(mean), 1.0), variance, 1.0).tolist()


@dataclass(frozen=True)
class Split:
    x: Arrays  # float32, (n, *feature_shape); or {input name: (n, *shape)}
    y: Arrays  # int64 class ids (n,); float32 one-hot rows (n, k); float32 targets (n,) or (n, *label_shape)
    ids: np.ndarray  # int64, (n,)
    w: Optional[np.ndarray] = None  # float32 (n,): the data function's sample weights (training rows only)

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, index: np.ndarray) -> "Split":
        take = lambda a: a[index]  # noqa: E731
        return Split(nest_map(take, self.x), nest_map(take, self.y), self.ids[index],
                     None if self.w is None else self.w[index])

    def weights(self) -> np.ndarray:
        return np.ones(len(self), np.float32) if self.w is None else self.w


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
    label_shape: tuple[int, ...] = ()  # one example's label: () a class id or a value; (k,) one-hot or k targets
    class_counts: Optional[tuple[int, ...]] = None  # training rows per class, where known before training
    input_shapes: Optional[dict[str, tuple[int, ...]]] = None  # named inputs (a dict x): each one's shape
    # Named outputs (a dict y): each one's label shape and task (classification, binary, regression).
    outputs: Optional[dict[str, tuple[tuple[int, ...], str]]] = None
    sample_weights: bool = False  # the training rows carry the data function's sample weights
    # Streamed files (Ray Data deals each worker its shard of whole batches): never a short last batch. How the rows
    # arrive, not what they are: two sources of the same rows have equal facts.
    streamed: bool = field(default=False, compare=False)
    # Each feature's mean and variance over the training rows (tabular data read before training; else None): what
    # the built-in mlp standardises its inputs with. Sums in another order give other last bits.
    feature_moments: Optional["Moments"] = field(default=None, compare=False, repr=False)
    # A regression's targets' mean and variance over the training rows, where read before training (else None): the
    # built-ins predict in their units (app.models.in_target_units).
    label_moments: Optional["Moments"] = field(default=None, compare=False, repr=False)
    # A label column of class names: the names, in class-id order (app.data.class_names); else ().
    class_names: tuple[str, ...] = ()

    @property
    def example_shape(self) -> Any:
        """One example's input shape: a tuple, or {input name: shape}."""
        return self.input_shapes if self.input_shapes is not None else tuple(self.feature_shape)

    def zeros(self, n: int, fill: Optional[Callable[[tuple[int, ...]], np.ndarray]] = None) -> Arrays:
        """``n`` examples of the inputs' shapes (zeros, or ``fill(shape)``): what a model is called on to check it."""
        make = fill or (lambda shape: np.zeros(shape, np.float32))
        if self.input_shapes is None:
            return make((n, *self.feature_shape))
        return {k: make((n, *shape)) for k, shape in self.input_shapes.items()}

    @property
    def label_dtype(self) -> str:
        return "float32" if self.task == "regression" or self.label_shape else "int64"


@dataclass(frozen=True)
class Source:
    """Train and validation arrays in memory, and their facts."""

    train: Split
    val: Split
    facts: DataFacts
    streamed = False  # app.data.streamed.Streamed: True; read where the input path differs


def split_holdout(x: Arrays, y: Arrays, val_fraction: float, seed: int, w: Optional[np.ndarray] = None
                  ) -> tuple[Split, Split]:
    """A seeded train/val split; ids are row indices in the source. Validation rows are unweighted (as Keras's
    validation_split: sample weights are a training matter)."""
    n = len(first(y))
    whole = Split(x, y, np.arange(n, dtype=np.int64), w)
    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    if n_val == 0 or n_val == n:
        raise UserError(f"val_fraction={val_fraction} leaves an empty train or val set for {n} rows")
    val = whole.rows(np.sort(perm[:n_val]))
    return whole.rows(np.sort(perm[n_val:])), Split(val.x, val.y, val.ids)


def split_last(x: Arrays, y: Arrays, fraction: float, w: Optional[np.ndarray] = None) -> tuple[tuple, tuple]:
    """Keras's ``validation_split``: the last ``fraction`` of the rows, in their given order, are validation.

    The cut is Keras's own (``floor(n * (1 - fraction))``), so a script moved from ``model.fit`` validates
    on the same rows. The two parts go to the source as explicit train and val arrays (memory.arrays_from):
    (x, y[, w]) and (x_val, y_val) (validation is unweighted).
    """
    n = len(first(y))
    split_at = int(np.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise UserError(f"validation_split={fraction} leaves an empty train or val set for {n} rows")
    head, tail = (lambda a: a[:split_at]), (lambda a: a[split_at:])
    train = (nest_map(head, x), nest_map(head, y)) + (() if w is None else (w[:split_at],))
    return train, (nest_map(tail, x), nest_map(tail, y))


def zero_weight_padding(n: int, multiple: int) -> int:
    """How many weight-0 rows make ``n`` divisible by ``multiple``."""
    return (-n) % multiple


def padded_with_zero_weight(split: Split, multiple: int) -> tuple[Arrays, Arrays, np.ndarray, np.ndarray]:
    """(x, y, ids, weights) with weight-0 copies of the first row appended until the count divides by ``multiple``.

    Padding rows have id -1 and weigh nothing in the loss and metric sums; they
    exist so that every worker or replica gets the same number of eval batches.
    """
    x, y, ids = split.x, split.y, split.ids
    w = np.ones(len(ids), dtype=np.float32)
    pad = zero_weight_padding(len(ids), multiple)
    if pad:
        grow = lambda a: np.concatenate([a, np.repeat(a[:1], pad, axis=0)])  # noqa: E731
        x, y = nest_map(grow, x), nest_map(grow, y)
        ids = np.concatenate([ids, np.full(pad, -1, dtype=np.int64)])
        w = np.concatenate([w, np.zeros(pad, dtype=np.float32)])
    return x, y, ids, w
