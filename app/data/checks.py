"""Checks every data source shares, each failing with one line that names the column and the fix."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from app.errors import UserError


def check_labels(what: str, low: int, high: int, num_classes: Optional[int], rows: Optional[int] = None) -> None:
    """Class ids must be 0..K-1; ``what`` names them ("label column 'y'"). Counted from the labels (no
    --num-classes), no more classes than ``rows`` (``check_class_count``)."""
    if low < 0:
        raise UserError(f"{what}: a label is negative ({low}); class ids must be 0..K-1")
    if num_classes is None and rows is not None:
        check_class_count(what, high, rows, "give --task regression if they are numbers to predict (a price, a "
                          "count), or --num-classes if they are class ids")
    if num_classes is not None and high >= num_classes:
        raise UserError(
            f"{what}: labels go up to {high}, but --num-classes is {num_classes} (class ids must be "
            f"0..{num_classes - 1}): raise --num-classes to {high + 1}, or leave it out to count the classes"
        )


def check_class_count(what: str, high: int, rows: int, fix: str, model: str = "") -> None:
    """Class ids counted from the labels (the largest + 1) may not outnumber the ``rows``: such integers are numbers
    to predict (a price, a year), and a classifier with an output per value up to the largest would not learn them.
    ``fix`` ends the line; ``model`` names the built-in sized by them."""
    if high + 1 > rows:
        raise UserError(f"{what}: integer labels up to {high:,} make {high + 1:,} classes"
                        f"{f' for the {model}' if model else ''}, more than the {rows:,} rows: {fix}")


def missing(kind: str, name: str, uri: str, existing: list[str], flag: Optional[str] = None) -> UserError:
    """``flag``: the option that names it, which the line tells the user to give one of ``existing`` with."""
    fix = f": give {flag} one of them" if flag and existing else ""
    return UserError(f"{kind} {name!r} not found in dataset {uri!r}: it has {', '.join(existing) or 'nothing'}{fix}")


# How a NaN/inf refusal ends, for every source.
NONFINITE_FIX = "(a NaN poisons every weight it reaches): drop or fill those rows first"
# A label column of class names (strings) is refused: its fix.
LABEL_NAMES_FIX = ("map each class name to an id 0..K-1 first (pandas: df[column] = "
                   "df[column].astype('category').cat.codes)")


def check_finite(values: np.ndarray, what: str) -> None:
    """NaN or inf in features or targets: refused with a count (a NaN poisons every weight it touches)."""
    if values.dtype.kind != "f":
        return
    bad = int(np.count_nonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1)))
    if bad:
        raise UserError(
            f"{what}: {bad} of {len(values)} rows hold NaN or infinite values {NONFINITE_FIX}"
        )


def task_of(y: np.ndarray, requested: str, what: str) -> str:
    """auto: integer labels -> classification, floats -> regression; an explicit task must fit the labels."""
    integral = y.dtype.kind in "iub"
    if requested == "auto":
        return "classification" if integral else "regression"
    if requested in ("classification", "binary") and not integral:
        raise UserError(
            f"{what} has {y.dtype} values, but --task {requested} needs integer class ids: "
            "use --task regression for continuous targets"
        )
    if requested == "binary" and len(y) and (y.min() < 0 or y.max() > 1):
        raise UserError(f"{what} has values {int(y.min())}..{int(y.max())}, but --task binary needs labels 0 or 1")
    return requested


def refuse_unreadable(x: Any, y: Any, sample_weight: Any, what: str) -> None:
    """Arrays Keras's array adapter refuses deep in its slicing, in one line: of strings ("Invalid dtype: str128",
    as its validation_split says; a tf.data.Dataset carries strings into a model that takes them, a
    TextVectorization inside it, so the fix names it), of Python objects ("Invalid dtype: object"), and labels or
    weights given as a list of numbers (an IndexError: Keras reads a list as one array per output)."""
    import tensorflow as tf

    for part, value in (("y", y), ("sample_weight", sample_weight)):
        if isinstance(value, (list, tuple)) and value and np.ndim(value[0]) == 0:
            raise UserError(f"{part} is a {type(value).__name__} of {len(value)} numbers, which Keras reads as "
                            f"{len(value)} separate arrays (one per output): give np.asarray({part})")

    for part, value in (("y", y), ("x", x)):
        name = part if what == "x" else f"{what}'s {part}"
        for a in tf.nest.flatten(value):
            if isinstance(a, np.ndarray) and a.size and (a.dtype.kind in "US" or a.dtype.kind == "O" and
                                                         isinstance(a.flat[0], (str, bytes))):
                fix = "map them to class ids first: np.unique(y, return_inverse=True)[1]" if part == "y" else \
                    ("map them to token ids first (a keras.layers.TextVectorization adapted to them), or, for a model "
                     "that takes strings itself, give a tf.data.Dataset instead: "
                     "tf.data.Dataset.from_tensor_slices((x, y)).batch(32)")
                raise UserError(f"{name} holds strings ({a.dtype}, e.g. {str(a.flat[0])!r}), and Keras's fit takes "
                                f"numbers from arrays: {fix}")
            if isinstance(a, np.ndarray) and a.dtype.kind == "O":  # Keras: "Invalid dtype: object", deep in a batch
                raise UserError(f"{name} is an array of Python objects (dtype object, shape {a.shape}"
                                + (f", the first a {type(a.flat[0]).__name__!r}" if a.size else "")
                                + "), and Keras's fit takes numbers "
                                f"from arrays: make it numbers first (np.asarray({part}, dtype='float32') for rows "
                                "of numbers, np.stack for a column of arrays)")
