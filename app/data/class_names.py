"""A label column of class names (strings, in CSV, parquet or a Ray Dataset): each name's class id, decided once.

The ids are the names' places in the run's ``class_names``: --class-names as given, else every name of the
training rows, sorted (``with_class_names``). The driver decides them reading the training rows (the statistics pass
of a built-in's files, one pass over the label column for a model of the user's, or the rows read here on the local
backend), and the run's config carries them from there (``decided``): validation rows are read with them, workers
map the names with them, config.yaml records them, and evaluation and prediction of the run map names as training
did. A name they lack is one line before any worker starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from app.errors import UserError

# An app.data.schema.Spec (which asks here, so it is not imported here): its label, label_names and classes.
Spec = Any

if TYPE_CHECKING:
    import pyarrow as pa

    from app.config import TrainConfig


def with_class_names(spec: Spec, found: Iterable[str], where: str) -> Spec:
    """The spec with its classes: the run's (--class-names, or a training run's record), else every name ``found``
    in the training rows, sorted. A name ``found`` that the run's classes lack is one line naming ``where``."""
    found = set(found)
    if not spec.classes:
        return replace(spec, classes=tuple(sorted(found)))
    if len(set(spec.classes)) < len(spec.classes):
        twice = sorted({n for n in spec.classes if spec.classes.count(n) > 1})
        raise UserError(f"--class-names lists {', '.join(map(repr, twice))} more than once: give each class once")
    if unknown := sorted(found - set(spec.classes)):
        shown = ", ".join(map(repr, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise UserError(f"label column {spec.label!r} of {where} holds class names the run's classes "
                        f"({', '.join(spec.classes)}) lack: {shown}; add them to --class-names (in class-id order), or "
                        "drop those rows")
    return spec


def decided(config: "TrainConfig", spec: Spec) -> "TrainConfig":
    """The config with the class names the training rows' spec decided: what validation and evaluation rows are
    read with, and what config.yaml records."""
    if not spec.label_names or list(spec.classes) == config.class_names:
        return config
    return config.model_copy(update={"class_names": list(spec.classes)})


def labels_text(num_classes: Optional[int], spec: Spec) -> str:
    """How the data's line names the labels: "3 classes", with their names for a column of names, or float targets."""
    if not num_classes:
        return "float targets"
    names_ = f" ({', '.join(spec.classes[:10])}{', ...' if len(spec.classes) > 10 else ''})" if spec.label_names else ""
    return f"{num_classes} classes{names_}"


def names(table: "pa.Table", column: str) -> "pa.Array":
    """A column of class names as plain strings (a pandas category column is a dictionary of them)."""
    import pyarrow as pa

    values = table.column(column)
    values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    return values.cast(values.type.value_type) if pa.types.is_dictionary(values.type) else values


def distinct(table: "pa.Table", column: str) -> list[str]:
    """The class names a table's column holds, each once (missing ones left out: they are refused apart)."""
    import pyarrow.compute as pc

    return pc.unique(names(table, column)).drop_null().to_pylist()


def class_ids(table: "pa.Table", spec: Spec) -> np.ndarray:
    """A block's class names -> their ids (their places in ``spec.classes``). A name the run's classes lack is one
    line (the driver's checks find such names first, where they read the rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not spec.classes:
        raise RuntimeError(f"label column {spec.label!r}: class names read before their ids were decided")
    given = names(table, spec.label)
    if given.null_count:
        raise UserError(f"label column {spec.label!r} has {given.null_count} missing class names: drop those rows "
                        f"first (pandas: df.dropna(subset=[{spec.label!r}]))")
    ids = pc.index_in(given, value_set=pa.array(spec.classes, given.type))
    if ids.null_count:
        with_class_names(spec, distinct(table, spec.label), "these rows")
    return ids.to_numpy(zero_copy_only=False).astype(np.int64)
