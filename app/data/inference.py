"""Rows to predict on, from every source --dataset takes, prepared as training prepares them.

- parquet, CSV, image folders: read a batch at a time in this process (app.data.local_files, --backend local), or
  by Ray Data (app.data.streamed's reader) for the actors of app.tools.predict;
- in memory: a built-in dataset, ``.npz``/``.npy`` files, a data function's (x, y) arrays, dict of splits or
  DataFrame, or what app.predict was given (x alone too): one pyarrow table, the features as an ``x`` tensor column;
- a data function's (or app.predict's) ``ray.data.Dataset``: as it is (Ray only).

The features come from the data's own schema through the training path's ``schema_spec`` (the run's
--feature-columns, --text-column, --image-size; no label needed) and each batch through ``blocks.features``: the
same columns, tokens, pixels and scaling as in training. The model's input shape is the reference: examples
holding as many values are reshaped to it (the digits' 64 values for a cnn's 8x8x1), others are refused with one
line, from the first rows, before any prediction runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np

from app.backend import backend_of
from app.data import files, local_files, memory
from app.data.arrays import X, concatenated, first
from app.data.blocks import batch_rows, features, values_in_first_row
from app.data.checks import missing
from app.data.schema import Spec, schema_spec
from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from app.config import TrainConfig

# Arrays from Python (or a data function) without labels of their own: the row's position is kept instead.
ROW = "row"


@dataclass(frozen=True)
class Rows:
    """Where the rows to predict on are: files or a Ray Dataset (``loc``), or one in-memory table."""

    what: str  # the dataset, as messages name it
    loc: files.Located  # format "arrays" (features in one column, X) or "dataframe" for ``table``
    table: Optional["pa.Table"] = None
    named: tuple[tuple[str, tuple[int, ...]], ...] = ()  # a dict of arrays: each input's column and example shape

    @property
    def in_memory(self) -> bool:
        return self.table is not None


def rows_of(config: "TrainConfig", given: Any = None) -> Rows:
    """--dataset, or what app.predict was given (arrays, (x, y), a DataFrame, a ray.data.Dataset), as Rows."""
    from app import registry

    if given is None:
        loc = files.located(config)
        if loc is not None and loc.format != "numpy":
            return Rows(loc.uri, loc)
        if loc is not None:
            from app.data.numpy_files import load_numpy

            x, y = load_numpy(config, config.dataset, need_labels=False)
            return _in_memory(x if y is None else (x, y), config, f"dataset {config.dataset!r}")
        given = memory.call_data_function(config)
        what = config.dataset if isinstance(config.dataset, str) else registry.describe(config.dataset)
    else:
        what = "the data given"
    if memory.is_ray_dataset(given):
        return Rows(what, files.given_dataset(what, given))
    return _in_memory(given, config, what)


def _in_memory(value: Any, config: "TrainConfig", what: str) -> Rows:
    import pyarrow as pa

    if type(value).__name__ == "DataFrame" and hasattr(value, "columns"):  # its columns, as a CSV file's
        return Rows(what, files.Located(what, "dataframe", None, "", ()), pa.Table.from_pandas(value, preserve_index=False))
    if isinstance(value, (np.ndarray, dict)) and not _is_splits(value):  # x alone: an array, or named arrays
        x, y = memory.named(value, what, "x"), None
    else:
        (x, y, _), val = memory.arrays_from(value, config, what)  # weights do not change a prediction
        if val is not None:  # {"train": ..., "val": ...}: every row, the training rows first
            x = concatenated(x, val[0])
            y = concatenated(y, val[1])
    inputs = x if isinstance(x, dict) else {X: x}
    n = len(first(x))
    if not n:
        raise UserError(f"{what} has no rows to predict (0 examples): give data with at least one row")
    for name, a in inputs.items():
        if a.ndim < 2 or len(a) != n or not n or a.dtype.kind not in "fiub":
            where = f"x[{name!r}]" if isinstance(x, dict) else "x"
            raise UserError(f"{what}: {where} of shape {a.shape} and dtype {a.dtype}; expected numbers, one "
                            f"example per row ({n or 'n'}, ...)")
    if isinstance(x, dict) and (clash := {ROW, config.label_column} & set(x)):
        raise UserError(f"{what}: an input named {clash.pop()!r}, which predictions use for their own column: "
                        "rename the model's input")
    # Each input's examples flattened into one list column: reshaped to the model's input by the spec.
    columns = {name: _list_column(a) for name, a in inputs.items()}
    columns[ROW] = pa.array(np.arange(n, dtype=np.int64))
    if y is not None and not isinstance(y, dict):
        columns[config.label_column] = pa.array(y)
    named = tuple((name, tuple(a.shape[1:])) for name, a in x.items()) if isinstance(x, dict) else ()
    return Rows(what, files.Located(what, "arrays", None, "", ()), pa.table(columns), named)


def _is_splits(value: Any) -> bool:
    return isinstance(value, dict) and "train" in value


def _list_column(a: np.ndarray) -> "pa.Array":
    import pyarrow as pa

    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(len(a), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def first_rows(rows: Rows, config: "TrainConfig", keep: Sequence[str], n: int = 64) -> "pa.Table":
    """A few raw rows, read the way the predictions will read them (Ray Data's reader on Ray)."""
    if rows.in_memory:
        return rows.table.slice(0, n)
    if not backend_of(config).on_ray:
        if rows.loc.format == "ray-dataset":
            raise UserError(f"{rows.what} returned a ray.data.Dataset, which streams through Ray Data: predict on it "
                            "with --backend ray, or return arrays")
        first = next(iter(local_files.batches(rows.loc, config, *_every_column(rows, config))), None)
    else:
        first = ray_dataset(rows, config).limit(n).take_batch(n, batch_format="pyarrow")
    if first is None or not first.num_rows:
        raise UserError(f"dataset {rows.what!r} is empty: 0 rows")
    return first.slice(0, n)


def spec_for(rows: Rows, config: "TrainConfig", first: "pa.Table", keep: Sequence[str],
             model_shape: Optional[tuple[int, ...]]) -> Spec:
    """How each raw batch becomes the model's input, checked on ``first``: columns, types, shapes."""
    import pyarrow.compute as pc

    names = first.column_names
    for name in keep:
        if name not in names:
            raise missing("column to keep (--keep-columns)", name, rows.what, names)
    if isinstance(model_shape, dict) and not rows.named and rows.loc.format != "arrays":
        return _columns_spec(rows, config, first, model_shape)
    if rows.named or isinstance(model_shape, dict):
        return _named_spec(rows, model_shape)
    if rows.loc.format == "arrays":  # one list column of each example's values
        config = config.model_copy(update={"feature_columns": [X], "text_column": None})
    elif not config.feature_columns and not config.text_column:  # the run's default: every other column
        skip = {config.label_column, *keep}
        config = config.model_copy(update={"feature_columns": [n for n in names if n not in skip] or names})
    if rows.loc.format == "images":  # decoded and resized as in training (schema.image_spec), scaled to [0, 1]
        h, w = config.image_size
        spec = Spec(kind="images", features=("image",), label="", stored_shape=(h, w, 3) if config.image_channels == 3
                    else (h, w))
    else:
        spec = schema_spec(rows.loc, config, first.schema, labelled=False)
    if spec.kind == "list":  # a list column's length is only known from the data
        lengths = pc.list_value_length(first.column(spec.features[0]))
        low, high = pc.min_max(lengths)["min"].as_py(), pc.min_max(lengths)["max"].as_py()
        if low != high:
            raise UserError(f"feature column {spec.features[0]!r} has ragged feature shapes: lists of length {low} "
                            f"to {high} (every example must have the same shape)")
        spec = replace(spec, stored_shape=(low,))
    stored = spec.feature_shape or spec.stored_shape
    shape = model_shape or tuple(config.feature_shape or stored)
    if math.prod(shape) != math.prod(stored):
        raise UserError(
            f"the rows of {rows.what!r} do not fit the model: feature column(s) {', '.join(spec.features)} give "
            f"examples of shape {tuple(stored)} ({math.prod(stored)} values), the model takes {shape} "
            f"({math.prod(shape)} values): name the run's feature columns with --feature-columns (or --text-column)")
    spec = replace(spec, feature_shape=tuple(shape))
    features(first.slice(0, 2), spec)  # decodes: a column that cannot be read as numbers fails here
    return spec


def _named_spec(rows: Rows, model_shapes: Any) -> Spec:
    """A dict of arrays for a model of several inputs: matched by name, each reshaped to its input."""
    given = dict(rows.named)
    if not isinstance(model_shapes, dict):
        raise UserError(f"{rows.what} is a dict of arrays ({', '.join(given)}) and the model takes one input: give x "
                        "as one array")
    if not given:
        raise UserError(f"the model takes {len(model_shapes)} inputs ({', '.join(model_shapes)}): give x as a dict of "
                        "arrays by input name (from Python, or a data function returning ({'a': ..., 'b': ...}, y))")
    if set(given) != set(model_shapes):
        lacking, unknown = sorted(set(model_shapes) - set(given)), sorted(set(given) - set(model_shapes))
        raise UserError(f"{rows.what}: the model's inputs are {', '.join(model_shapes)}; "
                        + "; ".join(filter(None, [f"missing {', '.join(lacking)}" if lacking else "",
                                                  f"no input named {', '.join(unknown)}" if unknown else ""])))
    for name, shape in model_shapes.items():
        if shape is not None and math.prod(shape) != math.prod(given[name]):
            raise UserError(f"{rows.what}: x[{name!r}] holds examples of shape {given[name]}, the model's input "
                            f"{name!r} takes {shape}")
    inputs = tuple((name, tuple(model_shapes[name] or given[name])) for name in model_shapes)
    return Spec(kind="named", features=tuple(model_shapes), label="", inputs=inputs)


def _columns_spec(rows: Rows, config: "TrainConfig", first: "pa.Table", model_shapes: dict) -> Spec:
    """A model of several named inputs on file (or DataFrame) rows: each input from the column the run's --inputs
    names for it, else the column of its own name; each reshaped to its input."""
    names = first.column_names
    columns = {name: config.input_columns().get(name, name) for name in model_shapes}
    lacking = [f"{name!r}" + (f" (column {column!r})" if column != name else "")
               for name, column in columns.items() if column not in names]
    if lacking:
        raise UserError(f"{rows.what} has no column for the model's input(s) {', '.join(lacking)}; its columns are "
                        f"{', '.join(names)}: name each input's column with --inputs NAME=COLUMN")
    inputs = []
    for name, column in columns.items():
        values, shape = values_in_first_row(first, column), model_shapes[name]
        if shape is not None and math.prod(shape) != values:
            raise UserError(f"{rows.what}: column {column!r} holds {values} value(s) per row, the model's input "
                            f"{name!r} takes {shape}")
        inputs.append((name, tuple(shape) if shape is not None else (values,)))
    spec = Spec(kind="named", features=tuple(columns.values()), label="", inputs=tuple(inputs))
    features(first.slice(0, 2), spec)  # the first rows decode to these shapes
    return spec


def _every_column(rows: Rows, config: "TrainConfig") -> tuple[Spec, Optional[list[str]]]:
    """What local_files.batches needs to read every column: the image size; parquet's column names."""
    h, w = config.image_size
    spec = Spec(kind="images" if rows.loc.format == "images" else "scalars", features=(), label="",
                stored_shape=(h, w, config.image_channels))
    if rows.loc.format != "parquet":
        return spec, None  # CSV rows and decoded images come whole
    import pyarrow.parquet as pq

    return spec, pq.read_schema(rows.loc.files[0], filesystem=rows.loc.filesystem).names


def local_batches(rows: Rows, config: "TrainConfig", spec: Spec, keep: Sequence[str]) -> Iterator["pa.Table"]:
    """The raw rows in this process, a bounded batch at a time (--backend local)."""
    if rows.in_memory:
        yield from (rows.table.slice(start, batch_rows(spec)) for start in range(0, rows.table.num_rows,
                                                                                  batch_rows(spec)))
        return
    columns = [*spec.features, *(k for k in keep if k not in spec.features)]
    yield from local_files.batches(rows.loc, config, spec, columns)


def ray_dataset(rows: Rows, config: "TrainConfig", columns: Optional[Sequence[str]] = None, block_rows: int = 4096):
    """The raw rows as a Ray Dataset: files read block by block by Ray Data, as training reads them; in-memory rows
    in blocks of ``block_rows`` (one block goes to one actor: a single block would leave the others idle)."""
    import ray.data

    from app.data.streamed import read

    if rows.in_memory:
        table = rows.table
        ds = ray.data.from_arrow([table.slice(i, block_rows) for i in range(0, table.num_rows, block_rows)])
    else:
        ds = read(rows.loc, config)
    return ds.select_columns(list(dict.fromkeys(columns))) if columns else ds
