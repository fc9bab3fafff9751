"""In-memory sources -> train/val arrays: built-in datasets, .npz/.npy files, and users' data functions.

A data function (built-in or ``file.py:function``) is called with the config
fields it declares (``seed``, ``val_fraction``, ...) and may return:

- ``(x, y)`` arrays: split into train/val with the seeded ``--val-fraction``;
- ``{"train": (x, y), "val": (x, y)}``: used as given;
- a pandas DataFrame: features and label picked as for CSV
  (``--feature-columns``, ``--label-column``);
- a ``ray.data.Dataset``: streamed like parquet (app.data.streamed), not here.

Every source then gets the same checks (shapes, finite values, labels against
the task and ``--num-classes``) before anything starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from app import registry
from app.data import builtin
from app.data.arrays import DataFacts, Source, Split, split_holdout
from app.data.checks import check_finite, check_labels, task_of
from app.data.numpy_files import reshape
from app.errors import UserError

if TYPE_CHECKING:
    from app.config import TrainConfig

RAY_DATASET = "ray.data.Dataset"


def call_data_function(config: "TrainConfig") -> Any:
    """What the dataset function returns (built-ins included), called with the config fields it declares."""
    fn = registry.resolve(config.dataset, registry.DATASETS)
    name = config.dataset if isinstance(config.dataset, str) else registry.describe(config.dataset)
    return registry.call_with_declared(fn, config.model_dump(), name)


def is_ray_dataset(value: Any) -> bool:
    """A ray.data.Dataset (MaterializedDataset included), told without importing Ray."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("ray.data") for c in type(value).__mro__)


def _pair(value: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        got = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else \
            f"a {type(value).__name__}"
        raise UserError(f"{what} returned {got}; expected (x, y)")
    x, y = (np.asarray(a) for a in value)
    if x.ndim == 0 or y.ndim == 0:
        raise UserError(f"{what} returned x of shape {x.shape} and y of shape {y.shape}; expected x (n, ...) "
                        "and y (n,) (or (n, k): one-hot rows, or k targets)")
    if len(x) != len(y):
        raise UserError(f"{what} returned {len(x)} examples but {len(y)} labels")
    if len(y) == 0:
        raise UserError(f"{what} returned 0 rows")
    if x.dtype.kind not in "fiub":
        raise UserError(f"{what} returned features of dtype {x.dtype}; expected numbers")
    if y.dtype.kind not in "fiub":
        raise UserError(f"{what} returned labels of dtype {y.dtype}; expected integer class ids or float targets "
                        "(encode string labels as integers 0..K-1)")
    return x, y


def _frame(df, config: "TrainConfig", what: str) -> tuple[np.ndarray, np.ndarray]:
    """A pandas DataFrame: the label column and the feature columns (default: every other numeric column)."""
    columns = list(df.columns)
    if config.label_column not in columns:
        raise UserError(f"{what} returned a DataFrame without label column {config.label_column!r} "
                        f"(it has {', '.join(map(str, columns))}): set --label-column")
    features = config.feature_columns or [c for c in columns if c != config.label_column]
    unknown = [c for c in features if c not in columns]
    if unknown:
        raise UserError(f"{what} returned a DataFrame without feature column(s) {', '.join(unknown)}")
    text = [c for c in features if df[c].dtype.kind not in "fiub"]
    if text:
        raise UserError(f"{what}: feature column {text[0]!r} has dtype {df[text[0]].dtype}, expected numbers: "
                        "pick numeric columns with --feature-columns")
    return df[features].to_numpy(dtype=np.float32), df[config.label_column].to_numpy()


def arrays_from(value: Any, config: "TrainConfig", what: str) -> tuple[tuple[np.ndarray, np.ndarray], Any]:
    """A data function's result -> ((x, y), val pair or None)."""
    if isinstance(value, dict):
        if "train" not in value or set(value) - {"train", "val"}:
            raise UserError(f"{what} returned a dict with keys {', '.join(map(str, value))}; expected "
                            "'train' and optionally 'val'")
        val = _pair(value["val"], f"{what}['val']") if "val" in value else None
        return _pair(value["train"], f"{what}['train']"), val
    if type(value).__name__ == "DataFrame" and hasattr(value, "columns"):
        return _frame(value, config, what), None
    return _pair(value, what), None


def load_source(config: "TrainConfig", returned: Any = None) -> Source:
    """The config's dataset in memory, checked: built-in, data function, or .npz / .npy files.

    ``returned``: what the data function already returned, if it was called.
    """
    from app.data import numpy_files

    if registry.looks_like_path(config.dataset) if isinstance(config.dataset, str) else False:
        train_xy, val_xy = numpy_files.load_numpy(config, config.dataset), None
        what, labels = f"dataset {config.dataset!r}", f"label array {config.label_column!r}"
    else:
        what = config.dataset if isinstance(config.dataset, str) else registry.describe(config.dataset)
        value = returned if returned is not None else call_data_function(config)
        if is_ray_dataset(value):
            raise UserError(f"{what} returned a ray.data.Dataset: it streams through Ray Data, which this command "
                            "does not use; return (x, y) arrays, or train it with jobs/train.py")
        train_xy, val_xy = arrays_from(value, config, what)
        labels = f"{what}, labels"
    if config.val_dataset:
        val_xy = numpy_files.load_numpy(config, config.val_dataset)
    source = source_from_arrays(config, train_xy, val_xy, what, labels)
    image_shape = builtin.IMAGE_SHAPES.get(config.dataset) if isinstance(config.dataset, str) else None
    if image_shape and not config.feature_shape:  # carried with the data: a cnn takes the digits as they come
        source = replace(source, facts=replace(source.facts, image_shape=image_shape))
    return source


def source_from_arrays(config: "TrainConfig", train_xy, val_xy, what: str, labels: str) -> Source:
    """(x, y) [+ validation (x, y)] -> checked, typed train/val splits and their facts."""
    x, y = train_xy
    check_finite(np.asarray(x, dtype=np.float32) if x.dtype.kind != "f" else x, f"{what}, features")
    check_finite(y, labels)
    one_hot = is_one_hot(y, config.task)
    if y.ndim == 1:
        task = task_of(y, config.task, labels)
    elif one_hot and config.task in ("auto", "classification"):
        task = "classification"
    elif config.task in ("auto", "regression"):
        task = "regression"  # several targets per example
    else:
        raise UserError(f"{labels} have shape {y.shape[1:]} per example, which --task {config.task} does not take: "
                        "give class ids (n,) or one-hot rows (n, k) (0/1, one 1 per row), or --task regression")
    y_dtype = np.float32 if task == "regression" or y.ndim > 1 else np.int64
    x = np.asarray(x, dtype=np.float32)
    if config.feature_shape:
        x = reshape(x, tuple(config.feature_shape), "x")
    y = y.astype(y_dtype)
    if val_xy is not None:
        vx, vy = val_xy
        vx = np.asarray(vx, dtype=np.float32)
        if config.feature_shape:
            vx = reshape(vx, tuple(config.feature_shape), "x")
        if vx.shape[1:] != x.shape[1:]:
            raise UserError(f"validation examples have shape {vx.shape[1:]}, the training data {x.shape[1:]}")
        if np.shape(vy)[1:] != y.shape[1:]:
            raise UserError(f"validation labels have shape {np.shape(vy)[1:]}, the training labels {y.shape[1:]}")
        check_finite(vx, f"{what}, validation features")
        check_finite(vy, f"{what}, validation labels")
        if y.ndim == 1:
            task_of(vy, task, f"{what}, validation labels")
        vy = vy.astype(y_dtype)
        # Validation ids continue after the training ids: still one id per row.
        train = Split(x, y, np.arange(len(y), dtype=np.int64))
        val = Split(vx, vy, np.arange(len(y), len(y) + len(vy), dtype=np.int64))
    else:
        train, val = split_holdout(x, y, config.val_fraction, config.seed)
    num_classes, counts = None, None
    if one_hot:
        num_classes = y.shape[1]
        counts = tuple(int(c) for c in train.y.sum(axis=0))
    elif task != "regression":
        every = np.concatenate([train.y, val.y])
        check_labels(labels, int(every.min()), int(every.max()), config.num_classes)
        num_classes = 2 if task == "binary" else (config.num_classes or int(every.max()) + 1)
        counts = tuple(int(c) for c in np.bincount(train.y, minlength=num_classes))
    facts = DataFacts(tuple(x.shape[1:]), task, num_classes, len(train), len(val), label_shape=tuple(y.shape[1:]),
                      class_counts=counts)
    return Source(train=train, val=val, facts=facts)


def is_one_hot(y: np.ndarray, requested: str) -> bool:
    """Labels as Keras's categorical cross-entropy takes them: (n, k) rows of 0/1 with one 1 each."""
    if y.ndim != 2 or y.shape[1] < 2 or requested == "regression":
        return False
    return bool(np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all())
