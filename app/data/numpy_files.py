"""numpy data: a .npz file or a directory of .npy files -> (x, y) arrays in memory, schema-checked."""

from __future__ import annotations

import io
import math
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from app.data.checks import missing
from app.data.files import Located, locate
from app.errors import UserError

if TYPE_CHECKING:
    from app.config import TrainConfig


def _numpy_arrays(loc: Located) -> dict[str, Any]:
    """name -> array loader; arrays are only read when used (.npy memory-mapped when local)."""

    local = type(loc.filesystem).__name__ == "LocalFileSystem"

    def opener(path: str, key: Optional[str] = None):
        def load() -> np.ndarray:
            try:
                if local and key is None:
                    return np.load(path, mmap_mode="r", allow_pickle=False)
                with loc.filesystem.open_input_file(path) as f:
                    raw = io.BytesIO(f.read())
                arrays = np.load(raw, allow_pickle=False)
                return arrays[key] if key is not None else arrays
            except ValueError as e:
                if "allow_pickle" in str(e):  # object arrays: rows of different shapes
                    name = key or os.path.basename(path)[: -len(".npy")]
                    raise UserError(
                        f"array {name!r} in dataset {loc.uri!r} has ragged feature shapes (an object array): "
                        "every example must have the same shape"
                    ) from None
                raise

        return load

    if len(loc.files) == 1 and loc.files[0].endswith(".npz"):
        path = loc.files[0]
        if local:
            with np.load(path, allow_pickle=False) as z:
                names = list(z.files)
        else:
            with loc.filesystem.open_input_file(path) as f:
                names = list(np.load(io.BytesIO(f.read()), allow_pickle=False).files)
        return {name: opener(path, name) for name in names}
    return {os.path.basename(p)[: -len(".npy")]: opener(p) for p in loc.files if p.endswith(".npy")}


def load_numpy(config: "TrainConfig", uri: str, need_labels: bool = True) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Features and labels of a .npz file or .npy directory, schema-checked (labels: app.data.memory).
    ``need_labels=False`` (prediction): arrays without the label array are features alone (labels None)."""
    loc = locate(uri, config.data_format)
    if loc.format != "numpy":
        raise UserError(
            f"dataset {uri!r} is {loc.format} data, not numpy arrays (.npz, .npy): give --dataset and "
            "--val-dataset in one format"
        )
    if config.text_column:
        raise UserError("--text-column needs a parquet or CSV dataset (numpy arrays hold numbers)")
    if config.inputs:
        raise UserError(f"dataset {uri!r}: --inputs feeds named inputs from parquet, CSV or TFRecord columns, not from "
                        "numpy arrays; for a model of several inputs, give a data function (--dataset file.py:function) "
                        "that returns ({'name': array, ...}, labels), or write the arrays as parquet columns")
    arrays = _numpy_arrays(loc)
    names = sorted(arrays)
    features = config.feature_columns or [n for n in names if n != config.label_column]
    if config.label_column not in arrays and not need_labels and len(features) == 1 and features[0] in arrays:
        return arrays[features[0]](), None
    if config.label_column not in arrays:
        raise missing("label array", config.label_column, uri, names, "--label-column")
    if len(features) != 1:
        raise UserError(
            f"dataset {uri!r} has arrays {', '.join(names)}: name the one feature array with --feature-columns"
        )
    if features[0] not in arrays:
        raise missing("feature array", features[0], uri, names, "--feature-columns")
    x, y = arrays[features[0]](), arrays[config.label_column]()
    if y.dtype.kind not in "iu" and (config.task in ("classification", "binary") or y.dtype.kind not in "f"):
        raise UserError(
            f"label array {config.label_column!r} has dtype {y.dtype}, expected integers (class ids 0..K-1)"
        )
    if x.dtype.kind not in "fiub":
        raise UserError(f"feature array {features[0]!r} has dtype {x.dtype}, expected numbers: save it as numbers "
                        "(np.save with the array mapped to numbers first: class names to ids, text to token ids)")
    if y.ndim != 1:
        raise UserError(f"label array {config.label_column!r} has shape {y.shape}, expected one label per row")
    if len(y) == 0:
        raise UserError(f"dataset {uri!r} is empty: 0 rows")
    if len(x) != len(y):
        raise UserError(
            f"feature array {features[0]!r} has {len(x)} rows but label array {config.label_column!r} has {len(y)}"
        )
    return x, y


def reshape(x: np.ndarray, shape: tuple[int, ...], column: str) -> np.ndarray:
    if math.prod(shape) != math.prod(x.shape[1:]):
        raise UserError(
            f"--feature-shape {'x'.join(map(str, shape))} holds {math.prod(shape)} values, but column {column!r} "
            f"has {math.prod(x.shape[1:])} per example (shape {'x'.join(map(str, x.shape[1:])) or 'scalar'})"
        )
    return x.reshape(len(x), *shape)

