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
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from app import registry
from app.data import builtin
from app.data.arrays import Arrays, DataFacts, Moments, Source, Split, first, nest_map, split_holdout
from app.data.checks import LABEL_NAMES_FIX, check_finite, check_labels, task_of
from app.data.numpy_files import reshape
from app.errors import UserError

if TYPE_CHECKING:
    from app.config import TrainConfig


def call_data_function(config: "TrainConfig") -> Any:
    """What the dataset function returns (built-ins included), called with the config fields it declares."""
    fn = registry.resolve(config.dataset, registry.DATASETS)
    name = config.dataset if isinstance(config.dataset, str) else registry.describe(config.dataset)
    return registry.call_with_declared(fn, config.model_dump(), name)


def is_ray_dataset(value: Any) -> bool:
    """A ray.data.Dataset (MaterializedDataset included), told without importing Ray."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("ray.data") for c in type(value).__mro__)


def _pair(value: Any, what: str) -> tuple[Arrays, Arrays, Optional[np.ndarray]]:
    """(x, y) or (x, y, sample_weight); x and y may be dicts of named arrays (several inputs, several outputs)."""
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        got = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else \
            f"a {type(value).__name__}"
        raise UserError(f"{what} returned {got}; expected (x, y) or (x, y, sample_weight)")
    x, y = (named(a, what, part) for a, part in zip(value[:2], ("x", "y")))
    w = np.asarray(value[2], dtype=np.float32) if len(value) == 3 else None
    n = len(first(y))
    for part, arrays in (("x", x), ("y", y)):
        for name, a in (arrays.items() if isinstance(arrays, dict) else [(None, arrays)]):
            where = f"{part}[{name!r}]" if name else part
            if a.ndim == 0 or (part == "y" and a.ndim > 2):
                raise UserError(f"{what} returned {where} of shape {a.shape}; expected x (n, ...) and y (n,) "
                                "(or (n, k): one-hot rows, or k targets)")
            if len(a) != n:
                raise UserError(f"{what} returned {len(a)} rows in {where} but {n} labels")
            if a.dtype.kind not in "fiub":
                raise UserError(f"{what} returned {where} of dtype {a.dtype}; expected numbers" + (
                    " (integer class ids or float targets; encode string labels as integers 0..K-1)"
                    if part == "y" else ": map it to numbers first (categories, pandas: "
                    "df[column].astype('category').cat.codes; a date: pd.to_datetime(df[column]).astype('int64'))"))
    if n == 0:
        raise UserError(f"{what} returned 0 rows")
    if w is not None and w.shape != (n,):
        raise UserError(f"{what} returned sample weights of shape {w.shape}; expected one per row: ({n},)")
    return x, y, w


def named(a: Any, what: str, part: str) -> Arrays:
    """An array, or a dict of named arrays (several inputs or outputs), as numpy."""
    if isinstance(a, dict):
        if not a:
            raise UserError(f"{what} returned an empty dict as {part}")
        return {str(k): np.asarray(v) for k, v in a.items()}
    return np.asarray(a)


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
    label = df[config.label_column]
    if label.dtype.kind not in "fiub":
        raise UserError(f"{what}: label column {config.label_column!r} holds {str(label.iloc[0])!r}, not a number: "
                        f"{LABEL_NAMES_FIX}")
    return df[features].to_numpy(dtype=np.float32), label.to_numpy()


def arrays_from(value: Any, config: "TrainConfig", what: str) -> tuple[tuple, Any]:
    """A data function's result -> ((x, y, sample weights or None), validation (x, y, None) or None).

    A ``tf.data.Dataset`` (or one per split) is read into arrays here, once (app.data.tf_datasets says why)."""
    from app.data import tf_datasets

    if isinstance(value, dict):
        value = {k: tf_datasets.materialise(v, f"{what}[{k!r}]") if tf_datasets.is_tf_dataset(v) else v
                 for k, v in value.items()}
    elif tf_datasets.is_tf_dataset(value):
        value = tf_datasets.materialise(value, what)
    if isinstance(value, dict):
        if "train" not in value or set(value) - {"train", "val"}:
            raise UserError(f"{what} returned a dict with keys {', '.join(map(str, value))}; expected "
                            "'train' and optionally 'val'")
        val = _pair(value["val"], f"{what}['val']") if "val" in value else None
        if val is not None and val[2] is not None:
            raise UserError(f"{what}['val'] has sample weights: validation is unweighted here (as Keras's "
                            "validation_split); give (x, y)")
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
        # Pixels share one scale: the mlp takes them as they are (standardised, the rare ink of an edge pixel is
        # blown up: the default run's val accuracy 0.972 where it is 0.986).
        source = replace(source, facts=replace(source.facts, image_shape=image_shape, feature_moments=None))
    return source


def source_from_arrays(config: "TrainConfig", train_xy, val_xy, what: str, labels: str) -> Source:
    """(x, y[, w]) [+ validation (x, y)] -> checked, typed train/val splits and their facts."""
    x, y, w = (*train_xy, None)[:3]
    x = _features(x, config, what)
    if isinstance(y, dict):  # several outputs: each label typed on its own; the first one names the task
        typed = {k: _typed_labels(v, config, f"{labels} {k!r}") for k, v in y.items()}
        y = {k: t[0] for k, t in typed.items()}
        _, task, one_hot = next(iter(typed.values()))
        outputs = {k: (tuple(t[0].shape[1:]), t[1]) for k, t in typed.items()}
    else:
        y, task, one_hot = _typed_labels(y, config, labels)
    if w is not None:
        check_finite(w, f"{what}, sample weights")
    if val_xy is not None:
        vx, vy = _features(val_xy[0], config, f"{what}, validation"), val_xy[1]
        if nest_map(lambda a: a.shape[1:], vx) != nest_map(lambda a: a.shape[1:], x):
            raise UserError(f"validation examples have shape {nest_map(lambda a: a.shape[1:], vx)}, the training "
                            f"data {nest_map(lambda a: a.shape[1:], x)}")
        if nest_map(lambda a: np.shape(a)[1:], vy) != nest_map(lambda a: a.shape[1:], y):
            raise UserError(f"validation labels have shape {nest_map(lambda a: np.shape(a)[1:], vy)}, the training "
                            f"labels {nest_map(lambda a: a.shape[1:], y)}")
        check = lambda a: check_finite(a, f"{what}, validation labels")  # noqa: E731
        nest_map(check, vy)
        if not isinstance(y, dict) and y.ndim == 1:
            task_of(vy, task, f"{what}, validation labels")
        vy = {k: np.asarray(vy[k]).astype(y[k].dtype) for k in y} if isinstance(y, dict) \
            else np.asarray(vy).astype(y.dtype)
        n = len(first(y))
        # Validation ids continue after the training ids: still one id per row.
        train = Split(x, y, np.arange(n, dtype=np.int64), w)
        val = Split(vx, vy, np.arange(n, n + len(first(vy)), dtype=np.int64))
    else:
        train, val = split_holdout(x, y, config.val_fraction, config.seed, w)
    num_classes, counts = None, None
    ty, vy = first(train.y), first(val.y)
    if one_hot:
        num_classes = ty.shape[1]
        counts = tuple(int(c) for c in ty.sum(axis=0))
    elif task != "regression":
        every = np.concatenate([ty, vy])
        check_labels(labels, int(every.min()), int(every.max()), config.num_classes, len(every))
        num_classes = 2 if task == "binary" else (config.num_classes or int(every.max()) + 1)
        counts = tuple(int(c) for c in np.bincount(ty, minlength=num_classes))
    facts = DataFacts(
        tuple(first(x).shape[1:]), task, num_classes, len(train), len(val), label_shape=tuple(ty.shape[1:]),
        class_counts=counts if not isinstance(y, dict) else None,
        input_shapes={k: tuple(a.shape[1:]) for k, a in x.items()} if isinstance(x, dict) else None,
        outputs=outputs if isinstance(y, dict) else None,
        sample_weights=w is not None,
        feature_moments=None if isinstance(x, dict) else Moments.of(train.x),
        label_moments=Moments.of_targets(ty) if task == "regression" and not isinstance(y, dict) else None,
    )
    return Source(train=train, val=val, facts=facts)


def _features(x: Arrays, config: "TrainConfig", what: str) -> Arrays:
    """float32, finite, reshaped to --feature-shape (one input only: named inputs keep their own shapes)."""
    if isinstance(x, dict) and config.feature_shape:
        raise UserError("--feature-shape reshapes one input; the data has named inputs "
                        f"({', '.join(x)}): give each array its shape in the data function")

    def one(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, dtype=np.float32)
        check_finite(a, f"{what}, features")
        return reshape(a, tuple(config.feature_shape), "x") if config.feature_shape else a

    return nest_map(one, x)


def _typed_labels(y: np.ndarray, config: "TrainConfig", labels: str) -> tuple[np.ndarray, str, bool]:
    """Labels as the task takes them: (cast labels, task, one-hot?)."""
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
    return y.astype(np.float32 if task == "regression" or y.ndim > 1 else np.int64), task, one_hot


def is_one_hot(y: np.ndarray, requested: str) -> bool:
    """Labels as Keras's categorical cross-entropy takes them: (n, k) rows of 0/1 with one 1 each."""
    if y.ndim != 2 or y.shape[1] < 2 or requested == "regression":
        return False
    return bool(np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all())
