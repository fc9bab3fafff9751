"""User data from files: format detection, schema checks, and Ray Data streaming with preprocessing.

Two paths, chosen by the format:

- ``.npz`` / a directory of ``.npy`` files: read with numpy (``.npy`` memory-
  mapped) into the in-memory ``data.Source``, the fast path for small data
  that the local backend uses too.
- parquet, CSV, image folders: Ray Data reads them block by block
  (``read_parquet`` / ``read_csv`` / ``read_images``, which take local paths
  and ``s3://`` / ``gs://`` URIs through pyarrow's filesystems) and
  ``map_batches`` turns each block into the columns every worker consumes:
  ``x`` (float32 features), ``y`` (int64 label), ``id`` (int64), plus ``w``
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

import copy
import hashlib
import logging
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.data

    from app.config import TrainConfig
    from app.data import Source

log = logging.getLogger(__name__)

X, Y, ID, W = "x", "y", "id", "w"  # the same column names as app.data
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff")
FILE_EXTENSIONS = {"parquet": "parquet", "csv": "csv", "npz": "numpy", "npy": "numpy"}
FILE_EXTENSIONS.update({ext: "images" for ext in IMAGE_EXTENSIONS})
# Preprocessed data is kept in the object store ("memory") when it takes at most
# this share of it: the rest is left for Ray Data's in-flight blocks and the
# workers' own objects.
CACHE_SHARE = 0.3
# Blocks of streamed data. Ray Data's default (128 MiB) is made for throughput
# over big clusters; here a block is what a worker maps and batches at a time and
# the unit of the read-ahead budget (--stream-buffer-mib), so a few MiB keeps
# both small and steady from the first blocks on, at any dataset size.
STREAM_BLOCK_BYTES = 16 << 20
_MASK63 = (1 << 63) - 1


def looks_like_path(name: str) -> bool:
    """A --dataset value that names files rather than a built-in dataset (existence is checked later)."""
    return "://" in name or "/" in name or os.sep in name or name.rsplit(".", 1)[-1].lower() in FILE_EXTENSIONS


# --------------------------------------------------------------------------- #
# Locating files                                                              #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Located:
    uri: str
    format: str  # parquet, csv, images, numpy
    filesystem: Any  # pyarrow.fs.FileSystem
    root: str  # path inside the filesystem
    files: tuple[str, ...]


def locate(uri: str, data_format: str = "auto") -> Located:
    """List the files behind a path or URI and tell their format (from the extensions unless given)."""
    import pyarrow.fs as pafs

    if "://" in uri:
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as e:  # pyarrow's errors say what is wrong (scheme, credentials, bucket)
            raise UserError(f"cannot open dataset {uri!r}: {e}") from None
    else:
        fs, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"dataset {uri!r} does not exist")
    if info.type == pafs.FileType.File:
        files = [root]
    else:
        listing = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        # Hidden and underscore files are writers' markers (_SUCCESS, .crc), not data.
        files = sorted(
            f.path for f in listing
            if f.type == pafs.FileType.File and not os.path.basename(f.path).startswith((".", "_"))
        )
    formats = {FILE_EXTENSIONS.get(f.rsplit(".", 1)[-1].lower()) for f in files} - {None}
    if data_format == "auto":
        if not files:
            raise UserError(f"dataset {uri!r} is empty: no files found")
        if len(formats) != 1:
            found = ", ".join(sorted(formats)) or "none of parquet, csv, npz, npy or images"
            raise UserError(
                f"cannot tell the format of dataset {uri!r}: its file extensions say {found}; "
                "set --data-format"
            )
        data_format = formats.pop()
    wanted = [f for f in files if FILE_EXTENSIONS.get(f.rsplit(".", 1)[-1].lower()) == data_format]
    if not wanted:
        raise UserError(f"dataset {uri!r} is empty: no {data_format} files found")
    return Located(uri, data_format, fs, root, tuple(wanted))


def is_streamed(config: "TrainConfig") -> bool:
    """True when --dataset is parquet, CSV or an image folder: the Ray Data path."""
    from app import data

    return config.dataset not in data.DATASETS and locate(config.dataset, config.data_format).format != "numpy"


# --------------------------------------------------------------------------- #
# Messages shared by both paths                                               #
# --------------------------------------------------------------------------- #


def _check_labels(column: str, low: int, high: int, num_classes: Optional[int], kind: str = "label column") -> None:
    if low < 0:
        raise UserError(f"{kind} {column!r} has a negative value ({low}): class ids must be 0..K-1")
    if num_classes is not None and high >= num_classes:
        raise UserError(
            f"{kind} {column!r} has values up to {high}, but --num-classes is {num_classes} "
            f"(class ids must be 0..{num_classes - 1})"
        )


def _missing(kind: str, name: str, uri: str, existing: list[str]) -> UserError:
    return UserError(f"{kind} {name!r} not found in dataset {uri!r}: it has {', '.join(existing) or 'nothing'}")


# --------------------------------------------------------------------------- #
# numpy: .npz or a directory of .npy -> data.Source (in memory)               #
# --------------------------------------------------------------------------- #


def _numpy_arrays(loc: Located) -> dict[str, Any]:
    """name -> array loader; arrays are only read when used (.npy memory-mapped when local)."""
    import io

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


def load_numpy(config: "TrainConfig", uri: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a .npz file or .npy directory, schema-checked."""
    loc = locate(uri, config.data_format)
    if loc.format != "numpy":
        raise UserError(
            f"dataset {uri!r} is {loc.format} data, which streams through Ray Data: train on it with "
            "jobs/train.py --backend ray (the local backend, evaluate and tune read in-memory data only: "
            "digits, synthetic, synthetic-text, .npz, .npy)"
        )
    if config.text_column:
        raise UserError("--text-column needs a parquet or CSV dataset (numpy arrays hold numbers)")
    arrays = _numpy_arrays(loc)
    names = sorted(arrays)
    if config.label_column not in arrays:
        raise _missing("label array", config.label_column, uri, names)
    features = config.feature_columns or [n for n in names if n != config.label_column]
    if len(features) != 1:
        raise UserError(
            f"dataset {uri!r} has arrays {', '.join(names)}: name the one feature array with --feature-columns"
        )
    if features[0] not in arrays:
        raise _missing("feature array", features[0], uri, names)
    x, y = arrays[features[0]](), arrays[config.label_column]()
    if y.dtype.kind not in "iu":
        raise UserError(
            f"label array {config.label_column!r} has dtype {y.dtype}, expected integers (class ids 0..K-1)"
        )
    if x.dtype.kind not in "fiub":
        raise UserError(f"feature array {features[0]!r} has dtype {x.dtype}, expected numbers")
    if y.ndim != 1:
        raise UserError(f"label array {config.label_column!r} has shape {y.shape}, expected one label per row")
    if len(y) == 0:
        raise UserError(f"dataset {uri!r} is empty: 0 rows")
    if len(x) != len(y):
        raise UserError(
            f"feature array {features[0]!r} has {len(x)} rows but label array {config.label_column!r} has {len(y)}"
        )
    _check_labels(config.label_column, int(y.min()), int(y.max()), config.num_classes, "label array")
    x = np.asarray(x, dtype=np.float32)
    if config.feature_shape:
        x = _reshape(x, tuple(config.feature_shape), features[0])
    return x, np.asarray(y, dtype=np.int64)


def _reshape(x: np.ndarray, shape: tuple[int, ...], column: str) -> np.ndarray:
    if math.prod(shape) != math.prod(x.shape[1:]):
        raise UserError(
            f"--feature-shape {'x'.join(map(str, shape))} holds {math.prod(shape)} values, but column {column!r} "
            f"has {math.prod(x.shape[1:])} per example (shape {'x'.join(map(str, x.shape[1:])) or 'scalar'})"
        )
    return x.reshape(len(x), *shape)


# --------------------------------------------------------------------------- #
# Streamed files: schema -> statistics pass -> preprocessing                  #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Spec:
    """How to turn one block of raw rows into x / y / id: a plain, picklable recipe sent to Ray Data tasks."""

    kind: str  # scalars, list, tensor, text, images
    features: tuple[str, ...]
    label: str
    stored_shape: tuple[int, ...] = ()  # one example as stored (before --feature-shape)
    feature_shape: tuple[int, ...] = ()  # one example as the model sees it
    vocab_size: int = 0
    sequence_length: int = 0
    classes: tuple[str, ...] = ()  # image folders: class names, index = label
    root: str = ""  # image folders: the root the class folders sit under
    val_fraction: Optional[float] = None  # None: no split (a separate validation source)
    seed: int = 0


@dataclass
class Streamed:
    """Ray Datasets ready for TensorflowTrainer, and the numbers the workers need."""

    train: "ray.data.Dataset"
    val: "ray.data.Dataset"
    feature_shape: tuple[int, ...]
    num_classes: int
    num_train_rows: int
    num_val_rows: int
    shuffle_buffer: int  # rows of each worker's local shuffle buffer (0: the dataset is shuffled globally)
    cached: dict[str, bool] = field(default_factory=dict)


def _type_kind(t: "pa.DataType") -> str:
    import pyarrow as pa

    if isinstance(t, pa.ExtensionType):
        if "VariableShaped" in type(t).__name__:
            return "ragged"
        if getattr(t, "shape", None) is not None:
            return "tensor"
        return "other"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        value = t.value_type
        return "list" if pa.types.is_integer(value) or pa.types.is_floating(value) else "other"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "scalar"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return "other"


def _schema_spec(loc: Located, config: "TrainConfig", schema) -> Spec:
    """Columns and dtypes from the schema alone (no data read): the cheap checks first."""
    import pyarrow as pa

    names = list(schema.names)
    types = dict(zip(names, schema.types))
    common = dict(
        label=config.label_column, vocab_size=config.vocab_size, sequence_length=config.sequence_length,
        seed=config.seed,
    )
    if config.label_column not in types:
        raise _missing("label column", config.label_column, loc.uri, names)
    label_type = types[config.label_column]
    if not pa.types.is_integer(label_type):
        raise UserError(
            f"label column {config.label_column!r} has type {label_type}, expected integers (class ids 0..K-1)"
        )
    if config.text_column:
        if config.text_column not in types:
            raise _missing("text column", config.text_column, loc.uri, names)
        if _type_kind(types[config.text_column]) != "string":
            raise UserError(f"text column {config.text_column!r} has type {types[config.text_column]}, expected strings")
        return Spec(kind="text", features=(config.text_column,), stored_shape=(config.sequence_length,), **common)
    features = config.feature_columns or [n for n in names if n != config.label_column]
    for name in features:
        if name not in types:
            raise _missing("feature column", name, loc.uri, names)
    if not features:
        raise UserError(f"dataset {loc.uri!r} has no feature columns besides the label {config.label_column!r}")
    kinds = {name: _type_kind(types[name]) for name in features}
    for name, kind in kinds.items():
        if kind == "ragged":
            raise UserError(f"feature column {name!r} has ragged feature shapes (tensors of varying shape)")
        if kind == "string":
            raise UserError(
                f"feature column {name!r} has type {types[name]}, expected numbers: pick numeric columns with "
                "--feature-columns, or tokenize it with --text-column"
            )
        if kind == "other":
            raise UserError(f"feature column {name!r} has type {types[name]}, expected numbers or lists of numbers")
    if set(kinds.values()) == {"scalar"}:
        return Spec(kind="scalars", features=tuple(features), stored_shape=(len(features),), **common)
    if len(features) > 1:
        raise UserError(
            f"feature columns {', '.join(features)} mix list/tensor and other columns: name one list or tensor "
            "column, or only scalar columns, with --feature-columns"
        )
    (name,) = features
    shape = tuple(types[name].shape) if kinds[name] == "tensor" else ()  # lists: length from the data
    return Spec(kind=kinds[name], features=(name,), stored_shape=shape, **common)


def _column(table: "pa.Table", name: str):
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _features(table: "pa.Table", spec: Spec) -> np.ndarray:
    """One block's features as float32 (n, *feature_shape); the block passed the checks."""
    import pyarrow.compute as pc

    from app import text

    n = table.num_rows
    if spec.kind == "scalars":
        x = np.stack(
            [_column(table, c).to_numpy(zero_copy_only=False).astype(np.float32, copy=False) for c in spec.features],
            axis=1,
        ) if n else np.zeros((0, len(spec.features)), np.float32)
    elif spec.kind == "list":
        values = pc.list_flatten(_column(table, spec.features[0])).to_numpy(zero_copy_only=False)
        x = values.astype(np.float32, copy=False).reshape(n, *spec.stored_shape)
    elif spec.kind in ("tensor", "images"):
        x = np.asarray(_column(table, spec.features[0]).to_numpy(), dtype=np.float32).reshape(n, *spec.stored_shape)
        if spec.kind == "images":
            x /= 255.0  # normalisation: pixels to [0, 1]
    elif spec.kind == "text":
        x = text.tokenize(_column(table, spec.features[0]).to_pylist(), spec.vocab_size, spec.sequence_length)
    else:
        raise AssertionError(spec.kind)
    return x.reshape(n, *(spec.feature_shape or spec.stored_shape))


def _labels(table: "pa.Table", spec: Spec) -> np.ndarray:
    if spec.kind == "images":
        index = {name: i for i, name in enumerate(spec.classes)}
        paths = _column(table, "path").to_pylist()
        return np.array([index[_class_of(p, spec.root)] for p in paths], dtype=np.int64)
    return _column(table, spec.label).to_numpy(zero_copy_only=False).astype(np.int64)


def _class_of(path: str, root: str) -> str:
    return os.path.relpath(path, root).split(os.sep)[0]


def _row_ids(table: "pa.Table", spec: Spec, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A 63-bit content hash per row (see the module docstring for why and what it costs)."""
    n = len(y)
    if spec.kind == "images":  # the path names an image; hashing it is cheaper than hashing pixels
        rows = [p.encode() for p in _column(table, "path").to_pylist()]
    elif spec.kind == "text":
        texts = _column(table, spec.features[0]).to_pylist()
        rows = [t.encode() + b"\0" + str(label).encode() for t, label in zip(texts, y.tolist())]
    else:
        flat = np.ascontiguousarray(x.reshape(n, -1))
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

    n = table.num_rows
    stats: dict[str, Any] = {"rows": n, "val_rows": 0, "label_min": 0, "label_max": 0, "label_nulls": 0}
    stats.update({"nulls_column": "", "nulls": 0, "len_min": -1, "len_max": -1})
    if spec.kind != "images":
        label = _column(table, spec.label)
        stats["label_nulls"] = label.null_count
        if n and label.null_count < n:
            mm = pc.min_max(label)
            stats["label_min"], stats["label_max"] = mm["min"].as_py(), mm["max"].as_py()
    for name in spec.features:
        nulls = _column(table, name).null_count
        if nulls and not stats["nulls"]:
            stats["nulls_column"], stats["nulls"] = name, nulls
    if spec.kind == "list" and n:
        lengths = pc.list_value_length(_column(table, spec.features[0]))
        mm = pc.min_max(lengths)
        stats["len_min"], stats["len_max"] = mm["min"].as_py(), mm["max"].as_py()
    ok = not stats["label_nulls"] and not stats["nulls"] and stats["len_min"] == stats["len_max"]
    if n and ok and spec.val_fraction is not None:
        if spec.kind == "list":  # the stored length is only known here; ids hash the flat row
            spec = replace(spec, stored_shape=(stats["len_min"],), feature_shape=(stats["len_min"],))
        y = _labels(table, spec)
        ids = _row_ids(table, spec, _features(table, spec), y)
        stats["val_rows"] = int(in_validation(ids, spec.seed, spec.val_fraction).sum())
    return pa.table({k: [v] for k, v in stats.items()})


def preprocess(table: "pa.Table", spec: Spec, keep: str, weights: bool) -> "pa.Table":
    """A raw block -> x / y / id (/ w): decode, normalise, tokenize, hash, and keep one side of the split."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    x, y = _features(table, spec), _labels(table, spec)
    ids = _row_ids(table, spec, x, y)
    if spec.val_fraction is not None and keep != "all":
        chosen = in_validation(ids, spec.seed, spec.val_fraction)
        if keep == "train":
            chosen = ~chosen
        x, y, ids = x[chosen], y[chosen], ids[chosen]
    columns = {X: ArrowTensorArray.from_numpy(x), Y: pa.array(y), ID: pa.array(ids)}
    if weights:
        columns[W] = pa.array(np.ones(len(y), dtype=np.float32))
    return pa.table(columns)


def _read(loc: Located, config: "TrainConfig", spec: Optional[Spec] = None, shuffle_seed: Optional[int] = None):
    """The raw Ray Dataset of a file source; with ``shuffle_seed``, the file order is reshuffled every epoch."""
    import ray.data
    from ray.data import FileShuffleConfig

    common: dict[str, Any] = {"filesystem": loc.filesystem}
    if shuffle_seed is not None:
        common["shuffle"] = FileShuffleConfig(seed=shuffle_seed, reseed_after_execution=True)
    files = list(loc.files)
    try:
        if loc.format == "parquet":
            ds = ray.data.read_parquet(files, **common)
            # Only the needed columns are read from the files (the projection is pushed into the read).
            return ds if spec is None else ds.select_columns([*spec.features, spec.label])
        if loc.format == "csv":
            return ray.data.read_csv(files, **common)
        if loc.format == "images":
            h, w = config.image_size
            mode = "RGB" if config.image_channels == 3 else "L"
            return ray.data.read_images(files, size=(h, w), mode=mode, include_paths=True, **common)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read dataset {loc.uri!r} as {loc.format}: {str(e).splitlines()[0]}") from None
    raise UserError(f"dataset {loc.uri!r}: format {loc.format!r} is not streamed")


def _image_spec(loc: Located, config: "TrainConfig") -> Spec:
    classes = sorted({_class_of(f, loc.root) for f in loc.files})
    loose = [f for f in loc.files if os.path.dirname(os.path.relpath(f, loc.root)) == ""]
    if loose:
        raise UserError(
            f"image folder {loc.uri!r} must hold one subfolder per class; found images directly in it "
            f"({os.path.basename(loose[0])})"
        )
    h, w = config.image_size
    shape = (h, w, 3) if config.image_channels == 3 else (h, w)
    return Spec(
        kind="images", features=("image",), label="<class folder>", stored_shape=shape, classes=tuple(classes),
        root=loc.root, seed=config.seed,
    )


def _inspect(loc: Located, config: "TrainConfig", val_fraction: Optional[float]) -> tuple[Spec, dict[str, int]]:
    """Schema checks, then one streaming statistics pass; returns the final spec and the totals."""
    if loc.format == "images":
        spec = _image_spec(loc, config)
    else:
        raw = _read(loc, config)
        try:
            schema = raw.schema()
        except Exception as e:  # noqa: BLE001 - a malformed file surfaces here; say which and why
            raise UserError(f"cannot read dataset {loc.uri!r} as {loc.format}: {str(e).splitlines()[0]}") from None
        if schema is None:
            raise UserError(f"dataset {loc.uri!r} is empty: 0 rows")
        spec = _schema_spec(loc, config, schema)
    spec = replace(spec, val_fraction=val_fraction)

    with _streaming(config):
        per_block = _read(loc, config, spec if loc.format == "parquet" else None).map_batches(
            block_stats, batch_format="pyarrow", batch_size=_batch_rows(spec), fn_kwargs={"spec": spec}
        )
    stats = per_block.take_all()
    total = {k: sum(s[k] for s in stats) for k in ("rows", "val_rows", "label_nulls", "nulls")}
    if total["rows"] == 0:
        raise UserError(f"dataset {loc.uri!r} is empty: 0 rows")
    if total["label_nulls"]:
        raise UserError(f"label column {spec.label!r} has {total['label_nulls']} missing values")
    if total["nulls"]:
        column = next(s["nulls_column"] for s in stats if s["nulls"])
        raise UserError(f"feature column {column!r} has {total['nulls']} missing values")
    if spec.kind == "list":
        lengths = [(s["len_min"], s["len_max"]) for s in stats if s["rows"]]
        low, high = min(a for a, _ in lengths), max(b for _, b in lengths)
        if low != high:
            raise UserError(
                f"feature column {spec.features[0]!r} has ragged feature shapes: lists of length {low} to {high} "
                "(every example must have the same shape)"
            )
        spec = replace(spec, stored_shape=(low,))
    shape = tuple(config.feature_shape) if config.feature_shape else spec.stored_shape
    if math.prod(shape) != math.prod(spec.stored_shape):
        raise UserError(
            f"--feature-shape {'x'.join(map(str, shape))} holds {math.prod(shape)} values, but column "
            f"{spec.features[0]!r} has {math.prod(spec.stored_shape)} per example"
        )
    spec = replace(spec, feature_shape=shape)
    if spec.kind == "images":
        total["label_min"], total["label_max"] = 0, len(spec.classes) - 1
    else:
        real = [s for s in stats if s["rows"]]
        total["label_min"] = min(s["label_min"] for s in real)
        total["label_max"] = max(s["label_max"] for s in real)
    _check_labels(spec.label, total["label_min"], total["label_max"], config.num_classes)
    return spec, total


def _batch_rows(spec: Spec) -> int:
    """Rows per preprocessing call: ~16 MiB of float32 features, whatever the size of Ray Data's blocks.

    A block can hold a whole file (or more): preprocessing it in one call would
    make a task's memory grow with the files, not with this bound.
    """
    row_bytes = 4 * math.prod(spec.stored_shape or (1024,))
    return max(16, (16 << 20) // row_bytes)


def _fits_in_memory(config: "TrainConfig", rows: int, spec: Spec, what: str) -> bool:
    import ray

    row_bytes = 4 * math.prod(spec.feature_shape) + 8 + 8 + 4  # x float32, y, id, w
    need = rows * row_bytes
    budget = CACHE_SHARE * ray.cluster_resources().get("object_store_memory", 0)
    if config.data_cache != "auto":
        cached = config.data_cache == "memory"
        reason = f"--data-cache {config.data_cache}"
    else:
        cached = need <= budget
        reason = f"{need / 2**20:,.0f} MiB preprocessed {'<=' if cached else '>'} {budget / 2**20:,.0f} MiB " \
                 f"({CACHE_SHARE:.0%} of the object store)"
    log.info(
        "%s data: %s (%s)", what,
        "preprocessed once, kept in the object store" if cached else "streamed, preprocessed block by block every epoch",
        reason,
    )
    return cached


def prepare(config: "TrainConfig", num_workers: int) -> Streamed:
    """Check a file source and build its train/val Ray Datasets (Ray must be running: the checks read data)."""
    from app import data

    loc = locate(config.dataset, config.data_format)
    val_loc = locate(config.val_dataset, config.data_format) if config.val_dataset else None
    if val_loc is not None and val_loc.format != loc.format:
        raise UserError(f"--val-dataset is {val_loc.format} data but --dataset is {loc.format}: use one format")
    spec, stats = _inspect(loc, config, None if val_loc else config.val_fraction)
    if val_loc is None:
        n_val = stats["val_rows"]
        n_train = stats["rows"] - n_val
        val_spec = spec
        if n_train == 0 or n_val == 0:
            raise UserError(
                f"val_fraction={config.val_fraction} leaves an empty train or val set for {stats['rows']} rows"
            )
    else:
        val_spec, val_stats = _inspect(val_loc, config, None)
        if val_spec.feature_shape != spec.feature_shape:
            raise UserError(
                f"--val-dataset examples have shape {val_spec.feature_shape}, the training data {spec.feature_shape}"
            )
        if spec.kind == "images" and val_spec.classes != spec.classes:
            raise UserError(
                f"--val-dataset has class folders {', '.join(val_spec.classes)}, the training data "
                f"{', '.join(spec.classes)}"
            )
        n_train, n_val = stats["rows"], val_stats["rows"]
        stats["label_max"] = max(stats["label_max"], val_stats["label_max"])
    num_classes = config.num_classes or stats["label_max"] + 1
    if spec.kind == "images":
        num_classes = config.num_classes or len(spec.classes)

    def pipeline(source: Located, s: Spec, keep: str, weights: bool, shuffle_seed: Optional[int], streamed: bool):
        with _streaming(config) if streamed else nullcontext():
            raw = _read(source, config, s if source.format == "parquet" else None, shuffle_seed)
            return raw.map_batches(
                preprocess, batch_format="pyarrow", batch_size=_batch_rows(s),
                fn_kwargs={"spec": s, "keep": keep, "weights": weights},
            )

    train_keep = "train" if val_loc is None else "all"
    cached = {"train": _fits_in_memory(config, n_train, spec, "training")}
    if cached["train"]:
        train = pipeline(loc, spec, train_keep, False, None, streamed=False).materialize()
        if config.shuffle:
            train = data.shuffled_each_epoch(train, config.seed)
        shuffle_buffer = 0
    else:
        # A global random_shuffle would hold the whole set at once: instead the
        # files are dealt in a new seeded order each epoch and each worker
        # shuffles rows in a local buffer.
        train = pipeline(loc, spec, train_keep, False, config.seed if config.shuffle else None, streamed=True)
        shuffle_buffer = config.shuffle_buffer if config.shuffle else 0

    cached["val"] = _fits_in_memory(config, n_val, val_spec, "validation")
    val = pipeline(val_loc or loc, val_spec, "val" if val_loc is None else "all", True, None, not cached["val"])
    if cached["val"]:
        val = val.materialize()
    val = _pad(val, n_val, num_workers, spec.feature_shape)
    log.info(
        "dataset %s (%s): %d training rows, %d validation rows, examples of shape %s, %d classes",
        loc.uri, loc.format, n_train, n_val, spec.feature_shape, num_classes,
    )
    return Streamed(train, val, spec.feature_shape, num_classes, n_train, n_val, shuffle_buffer, cached)


@contextmanager
def _streaming(config: "TrainConfig"):
    """Datasets created inside stream in small blocks with a bounded read-ahead.

    Ray Data seals the current DataContext into each Dataset it creates, so
    these settings belong to the datasets made here and to no other.

    - Blocks of ``STREAM_BLOCK_BYTES`` (Ray's default is 128 MiB): see there.
    - At most ``--stream-buffer-mib`` of the object store. Ray Data's default
      budget is half the store: reads run far ahead of training (the input is
      many times faster than the model), so a large dataset filled that much
      of the store, and every process that wrote or read a block kept those
      shared pages mapped. With both, the blocks in flight, and so the
      memory, are bounded by this setting instead of by the dataset's size
      (jobs/benchmark_memory.py: the budget alone, with 128 MiB blocks, did
      not hold).
    """
    from ray.data import DataContext

    context = DataContext.get_current()
    saved = context.target_max_block_size, context.execution_options
    options = copy.deepcopy(saved[1])
    options.resource_limits = options.resource_limits.copy(object_store_memory=config.stream_buffer_mib * 2**20)
    context.target_max_block_size, context.execution_options = STREAM_BLOCK_BYTES, options
    try:
        yield
    finally:
        context.target_max_block_size, context.execution_options = saved


def data_config(datasets: dict[str, "ray.data.Dataset"], cached: dict[str, bool]):
    """Ray Train's DataConfig: streamed datasets keep their own execution options (``_streaming``).

    Without it Ray Train replaces every dataset's options with the driver's
    current defaults. Cached datasets are already whole in the store: they
    keep Ray Train's defaults.
    """
    import ray.train

    options = {name: ds.context.execution_options for name, ds in datasets.items() if not cached[name]}
    return ray.train.DataConfig(execution_options=options or None)


def _pad(val: "ray.data.Dataset", rows: int, num_workers: int, feature_shape: tuple[int, ...]):
    """Weight-0 rows up to a multiple of the worker count: equal eval batches on every worker."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    pad = (-rows) % num_workers
    if not pad:
        return val
    table = pa.table({
        X: ArrowTensorArray.from_numpy(np.zeros((pad, *feature_shape), np.float32)),
        Y: pa.array(np.zeros(pad, np.int64)),
        ID: pa.array(np.full(pad, -1, np.int64)),
        W: pa.array(np.zeros(pad, np.float32)),
    })
    return val.union(ray.data.from_arrow(table))
