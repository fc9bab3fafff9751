"""Per-block transforms, run inside Ray Data tasks: raw rows -> x / y / id (/ w), and block statistics.

Three paths, chosen by the format and the backend:

- ``.npz`` / a directory of ``.npy`` files: read with numpy (``.npy`` memory-
  mapped) into the in-memory ``data.Source``, the fast path for small data
  that the local backend uses too.
- parquet, CSV, image folders with ``--backend local``: read in the process
  with pyarrow / Pillow (app.data.local_files), batch by batch through the
  same ``block_stats`` and ``rows`` as below, into the in-memory ``data.Source``.
- parquet, CSV, image folders on Ray: Ray Data reads them block by block
  (``read_parquet`` / ``read_csv`` / ``read_images``, which take local paths
  and ``s3://`` / ``gs://`` URIs through pyarrow's filesystems) and
  ``map_batches`` turns each block into the columns every worker consumes:
  ``x`` (float32 features), ``y`` (int64 class id, or float32 target for regression), ``id`` (int64), plus ``w``
  (weight) for validation. The driver never holds the data: it sees the
  schema, a few numbers per block from one statistics pass, and file names.

Every check (missing column, wrong dtype, ragged shapes, empty data, label out
of range) runs before any output directory or worker exists, and fails with a
one-line ``UserError`` naming the column and what was found.

Row identity without global row indices. A streamed block does not know its
rows' positions in the dataset, so a row's ``id`` is a 63-bit hash of its
content (features + label; an image's path; a text + label) and the seeded
validation split puts a row in validation when ``mix(id, seed)`` falls below
``val_fraction``. Trade-offs: ids are stable across runs, files, block sizes
and read order, and need no coordination; but identical rows share an id
(the exactly-once audit counts them once, and they always land in the same
split, which is the right thing for a holdout: no duplicate leaks from train
into val), the validation size is ``val_fraction`` of the rows only in
expectation (binomial; the exact counts come from the statistics pass), and
hashing costs one pass over each row's bytes per preprocessing run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from app.data import images
from app.data.arrays import ID, Moments, W, Y, nest_map, x_columns
from app.data.class_names import class_ids, distinct, names
from app.data.schema import TABULAR, Spec, class_of
from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

_MASK63 = (1 << 63) - 1


def _column(table: "pa.Table", name: str):
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def features(table: "pa.Table", spec: Spec) -> Any:
    """One block's features as float32 (n, *feature_shape), for training and for prediction (app.data.inference);
    a dict of such arrays, one per input, for kind "named"."""
    import pyarrow.compute as pc

    from app.data import text

    n = table.num_rows
    if spec.kind == "named":  # each input from its column: numbers, or lists of numbers flattened
        return {name: _numbers(_column(table, column)).reshape(n, *shape)
                for (name, shape), column in zip(spec.inputs, spec.features)}
    if spec.kind == "scalars":
        x = np.stack(
            [_column(table, c).to_numpy(zero_copy_only=False).astype(np.float32, copy=False) for c in spec.features],
            axis=1,
        ) if n else np.zeros((0, len(spec.features)), np.float32)
    elif spec.kind == "list":
        values = pc.list_flatten(_column(table, spec.features[0])).to_numpy(zero_copy_only=False)
        x = values.astype(np.float32, copy=False).reshape(n, *spec.stored_shape)
    elif spec.kind in ("tensor", "images"):
        column = _column(table, spec.features[0])
        # pyarrow's own tensor columns (local image reads, parquet written by pyarrow) / Ray Data's
        values = column.to_numpy_ndarray() if hasattr(column, "to_numpy_ndarray") else column.to_numpy()
        x = np.asarray(values, dtype=np.float32).reshape(n, *spec.stored_shape)
        if spec.kind == "images":
            x /= 255.0  # normalisation: pixels to [0, 1]
    elif spec.kind == "encoded":
        x = _decoded(table, spec) / np.float32(255.0)  # as an image folder's pixels
    elif spec.kind == "text":
        x = text.tokenize(_texts(table, spec), spec.vocab_size, spec.sequence_length)
    else:
        raise AssertionError(spec.kind)
    return x.reshape(n, *(spec.feature_shape or spec.stored_shape))


def _is_list(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _flat(column):
    """A column's values with every level of lists (and a Ray tensor column's list storage) flattened away."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column.type, pa.ExtensionType):  # Ray's tensor columns: a list array underneath
        column = column.storage
    while _is_list(column.type):
        column = pc.list_flatten(column)
    return column


def _numbers(column) -> np.ndarray:
    """A column of numbers or of lists of numbers (a Ray tensor column too) as one flat float32 array."""
    return _flat(column).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)


def values_in_first_row(table: "pa.Table", column: str) -> int:
    """How many numbers the first row of ``column`` holds (1 for a number, a list's length)."""
    return _numbers(_column(table.slice(0, 1), column)).size


def _decoded(table: "pa.Table", spec: Spec) -> np.ndarray:
    """A column of encoded images (PNG, JPEG, ...) -> (n, *stored_shape) float32 pixels 0..255."""
    name, (h, w) = spec.features[0], spec.stored_shape[:2]
    pixels = []
    for data in _column(table, name).to_pylist():
        try:
            pixels.append(images.decode(data, h, w, images.mode_of(spec.stored_shape)))
        except OSError:  # Pillow's reason names only the in-memory file
            raise UserError(f"feature column {name!r} holds bytes that are not an image Pillow decodes (PNG, JPEG, "
                            "...): store encoded images there, or name a text feature with --text-column") from None
    return np.asarray(pixels, np.float32).reshape(len(pixels), *spec.stored_shape)


def _texts(table: "pa.Table", spec: Spec) -> list:
    """The text column as str (TFRecord stores text as UTF-8 bytes; None stays None)."""
    values = _column(table, spec.features[0]).to_pylist()
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]


def _conformed(table: "pa.Table", spec: Spec) -> "pa.Table":
    """Numeric columns in the layout the spec was made from.

    Ray Data's TFRecord reader (and app.data.tfrecord) store a feature holding one value per record as a
    scalar column and a longer one as a list column, deciding per block: a block whose records all hold one
    value of a list feature has a scalar column there, which is wrapped back into lists of length 1 (the
    length check of app.data.schema.totals then names the mix); a list column where the spec has numbers
    (scalar features, the label) is unwrapped when every list holds one value, and refused otherwise.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    numeric = [*spec.features] if spec.kind == "scalars" else []
    # an image folder's labels are its class folders; class names are strings
    if spec.kind != "images" and not spec.label_names and spec.label in table.column_names:
        numeric.append(spec.label)
    if spec.kind == "list":
        column = _column(table, spec.features[0])
        if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
            offsets = pa.array(np.arange(len(column) + 1, dtype=np.int32))
            wrapped = pa.ListArray.from_arrays(offsets, column, mask=column.is_null())
            table = table.set_column(table.schema.get_field_index(spec.features[0]), spec.features[0], wrapped)
    for name in numeric:
        column = _column(table, name)
        if not pa.types.is_list(column.type):
            continue
        lengths = pc.list_value_length(column)
        longest = pc.max(lengths).as_py() or 0
        if longest > 1 or pc.min(lengths).as_py() == 0:
            what = "label column" if name == spec.label else "feature column"
            raise UserError(f"{what} {name!r} holds lists of {pc.min(lengths).as_py()} to {longest} values where other "
                            "records hold one number: every record must hold one number there")
        table = table.set_column(table.schema.get_field_index(name), name, pc.list_element(column, 0))
    return table


def _labels(table: "pa.Table", spec: Spec) -> np.ndarray:
    if spec.kind == "images":
        index = {name: i for i, name in enumerate(spec.classes)}
        paths = _column(table, "path").to_pylist()
        return np.array([index[class_of(p, spec.root)] for p in paths], dtype=np.int64)
    if spec.label_names:
        return class_ids(table, spec)
    return _column(table, spec.label).to_numpy(zero_copy_only=False).astype(
        np.float32 if spec.task == "regression" else np.int64)


def _row_ids(table: "pa.Table", spec: Spec, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A 63-bit content hash per row (see the module docstring for why and what it costs)."""
    n = len(y)
    if spec.label_names:  # by name, not by id: the statistics pass splits rows before the ids are decided
        y = np.fromiter((_hash63(str(v).encode()) for v in names(table, spec.label).to_pylist()), np.int64, count=n)
    if spec.kind == "images":  # the path names an image; hashing it is cheaper than hashing pixels
        rows = [p.encode() for p in _column(table, "path").to_pylist()]
    elif spec.kind == "text":
        rows = [(t or "").encode() + b"\0" + str(label).encode() for t, label in zip(_texts(table, spec), y.tolist())]
    elif spec.kind == "encoded":  # the encoded bytes name an image as well as its pixels do, and are shorter
        data = _column(table, spec.features[0]).to_pylist()
        rows = [d + b"\0" + str(label).encode() for d, label in zip(data, y.tolist())]
    else:
        parts = list(x.values()) if isinstance(x, dict) else [x]  # named inputs: their values one after the other
        flat = np.ascontiguousarray(np.concatenate([p.reshape(n, -1) for p in parts], axis=1))
        rows = ((flat[i], y[i : i + 1]) for i in range(n))  # features then label, hashed row by row: no copy
    ids = np.fromiter((_hash63(*parts) if isinstance(parts, tuple) else _hash63(parts) for parts in rows),
                      dtype=np.int64, count=n)
    return ids


def _hash63(*parts) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little") & _MASK63


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix (uint64 wrap-around is intended)."""
    z = z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def in_validation(ids: np.ndarray, seed: int, val_fraction: float) -> np.ndarray:
    """The seeded split: a row is validation when mix(id ^ mix(seed)) / 2^64 < val_fraction."""
    salt = _mix64(np.array([seed], dtype=np.int64).view(np.uint64))[0]
    u = (_mix64(ids.view(np.uint64) ^ salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < val_fraction


def block_stats(table: "pa.Table", spec: Spec) -> "pa.Table":
    """One row of statistics per block: the driver adds them up (it never sees the rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _conformed(table, spec)
    n = table.num_rows
    stats: dict[str, Any] = {"rows": n, "val_rows": 0, "label_min": 0, "label_max": 0, "label_nulls": 0}
    stats.update({"nulls_column": "", "nulls": 0, "nonfinite_column": "", "nonfinite": 0, "label_names": ""})
    if spec.kind != "images":
        label = _column(table, spec.label)
        stats["label_nulls"] = label.null_count
        bad = _nonfinite(label)  # float targets (regression)
        if bad:
            stats["nonfinite_column"], stats["nonfinite"] = spec.label, bad
        if spec.label_names:  # the names this block holds; the driver decides their ids from every block's
            stats["label_names"] = json.dumps(sorted(distinct(table, spec.label)))
        elif n and label.null_count < n:
            mm = pc.min_max(label)
            stats["label_min"], stats["label_max"] = mm["min"].as_py(), mm["max"].as_py()
    for name in spec.features:
        column = _column(table, name)
        if column.null_count and not stats["nulls"]:
            stats["nulls_column"], stats["nulls"] = name, column.null_count
        bad = 0 if stats["nonfinite"] else _nonfinite(column)
        if bad:
            stats["nonfinite_column"], stats["nonfinite"] = name, bad
    lengths = _lengths(table, spec)
    stats["lengths"] = json.dumps(lengths)
    ok = not stats["label_nulls"] and not stats["nulls"] and all(low == high for low, high in lengths.values())
    if spec.kind == "encoded" and ok and spec.val_fraction is None:
        _decoded(table, spec)  # every image decodes: checked before training, as the split below checks it
    stats["moments"] = stats["label_moments"] = ""
    regression = spec.task == "regression" and spec.kind != "images"
    rows_read = spec.val_fraction is not None or spec.kind in TABULAR  # the features, not only the labels
    if n and ok and (rows_read or regression):
        spec = _with_lengths(spec, {column: low for column, (low, _) in lengths.items()})  # ids hash the flat row
        x = features(table, spec) if rows_read else None
        y = np.zeros(n, np.int64) if spec.label_names else _labels(table, spec)  # names: no ids yet (ids hash names)
        training = np.ones(n, bool)
        if spec.val_fraction is not None:
            held = in_validation(_row_ids(table, spec, x, y), spec.seed, spec.val_fraction)
            stats["val_rows"], training = int(held.sum()), ~held
        for key, moments in (("moments", Moments.of(x[training]) if spec.kind in TABULAR else None),
                             ("label_moments", Moments.of_targets(y[training]) if regression else None)):
            if moments is not None:  # as text: every block's table has the same columns
                stats[key] = moments.as_text()
    return pa.table({k: [v] for k, v in stats.items()})


def _lengths(table: "pa.Table", spec: Spec) -> dict[str, tuple[int, int]]:
    """{column: (shortest, longest)} of the values per row of the columns whose length the data says: a list
    feature column; named inputs' number (1) and list columns. Empty blocks say nothing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not table.num_rows or spec.kind not in ("list", "named"):
        return {}
    shapes = dict(zip(spec.features, [s for _, s in spec.inputs])) if spec.kind == "named" else {}
    found = {}
    for name in spec.features:
        column = _column(table, name)
        if isinstance(column.type, pa.ExtensionType) or len(shapes.get(name, ())) > 1:
            continue  # a tensor column: its type has the shape
        if not _is_list(column.type):
            found[name] = (1, 1)
            continue
        mm = pc.min_max(pc.list_value_length(column))
        found[name] = (mm["min"].as_py(), mm["max"].as_py())
    return found


def _with_lengths(spec: Spec, length: dict[str, int]) -> Spec:
    """The spec with each list column's length as its examples' shape."""
    if spec.kind == "list" and spec.features[0] in length:
        return replace(spec, stored_shape=(length[spec.features[0]],), feature_shape=(length[spec.features[0]],))
    if spec.kind == "named":
        return replace(spec, inputs=tuple((name, (length[column],) if column in length else shape)
                                          for (name, shape), column in zip(spec.inputs, spec.features)))
    return spec


def _nonfinite(column) -> int:
    """How many NaN or infinite values a column holds, inside lists and tensors too (0 if not floating)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = _flat(column)
    if not pa.types.is_floating(column.type):
        return 0
    return len(column) - column.null_count - (pc.sum(pc.is_finite(column)).as_py() or 0)


def rows(table: "pa.Table", spec: Spec, keep: str = "all") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A raw block -> (x, y, ids) arrays: decode, normalise, tokenize, hash, and keep one side of the split.

    The Ray path calls it inside Ray Data tasks (``preprocess``), the local backend on pyarrow's batches
    (app.data.local_files): both get the same rows with the same ids.
    """
    table = _conformed(table, spec)
    x, y = features(table, spec), _labels(table, spec)
    ids = _row_ids(table, spec, x, y)
    if spec.val_fraction is not None and keep != "all":
        chosen = in_validation(ids, spec.seed, spec.val_fraction)
        if keep == "train":
            chosen = ~chosen
        x, y, ids = nest_map(lambda a: a[chosen], x), y[chosen], ids[chosen]
    return x, y, ids


def preprocess(table: "pa.Table", spec: Spec, keep: str, weights: bool) -> "pa.Table":
    """A raw block -> x / y / id (/ w) columns of a Ray Dataset (``rows``, as Ray Data's tensor columns)."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    x, y, ids = rows(table, spec, keep)
    columns = {**{k: ArrowTensorArray.from_numpy(a) for k, a in x_columns(x).items()}, Y: pa.array(y),
               ID: pa.array(ids)}
    if weights:
        columns[W] = pa.array(np.ones(len(y), dtype=np.float32))
    return pa.table(columns)


def keras_rows(table: "pa.Table", spec: Spec, labelled: bool) -> tuple[Any, Optional[np.ndarray]]:
    """A raw block -> (x, y) as Keras's fit takes them from a streamed input (app.data.keras_stream): the features
    as the product reads them (``features``), the label column's values as stored (y None: no label column)."""
    table = _conformed(table, spec)
    return features(table, spec), _labels(table, spec) if labelled else None


def keras_block(table: "pa.Table", spec: Spec, labelled: bool, holdout: Optional[tuple[str, float]] = None,
                ids: bool = False) -> "pa.Table":
    """A raw block -> the x (and y) columns of a streamed Keras input's Ray Dataset (``keras_rows``); ``holdout``
    ("train" or "val", fraction): one side of the seeded validation split by row content (the module docstring);
    ``ids``: each row's id (its content hash) in an ID column too (--audit-sample-ids)."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    x, y = keras_rows(table, spec, labelled)
    row_ids = _row_ids(table, spec, x, y if y is not None else np.zeros(table.num_rows, np.int64)) \
        if holdout is not None or ids else None
    if holdout is not None:
        side, fraction = holdout
        chosen = in_validation(row_ids, spec.seed, fraction)
        keep = chosen if side == "val" else ~chosen
        x, y, row_ids = nest_map(lambda a: a[keep], x), None if y is None else y[keep], row_ids[keep]
    columns = {k: ArrowTensorArray.from_numpy(a) for k, a in x_columns(x).items()}
    if y is not None:
        columns[Y] = ArrowTensorArray.from_numpy(y) if y.ndim > 1 else pa.array(y)
    if ids:
        columns[ID] = pa.array(row_ids)
    return pa.table(columns)


def batch_rows(spec: Spec) -> int:
    """Rows per preprocessing call: ~16 MiB of float32 features, whatever the size of the blocks read.

    A block can hold a whole file (or more): preprocessing it in one call would
    make a task's memory grow with the files, not with this bound.
    """
    return max(16, (16 << 20) // (4 * spec.values_per_row()))
