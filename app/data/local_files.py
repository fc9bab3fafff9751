"""parquet, CSV, TFRecord and image folders for ``--backend local``: read in this process, no Ray.

pyarrow reads parquet (``pyarrow.dataset``) and CSV (``pyarrow.csv.open_csv``, as Ray Data's CSV reader
does), app.data.tfrecord reads TFRecord files into the tables Ray Data's ``read_tfrecords`` gives, Pillow
decodes and resizes images (as Ray Data's ``read_images`` does: bilinear, then the colour mode). Each
batch then goes through the Ray path's own per-block code: ``block_stats`` and the checks over the totals
(app.data.schema.totals), then ``rows`` (app.data.blocks), so the checks, the features, the labels and
each row's id are the ones a Ray run computes. The validation rows are too: the seeded
content-hash split of app.data.blocks (or --val-dataset). The arrays then take the in-memory path
(app.data.arrays: a seeded permutation per epoch, every row once).

Everything is held in memory, so data that would not fit is refused, before it is all read, with one
line that names ``--backend ray`` (which streams it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from app.data import images, tfrecord
from app.data.arrays import DataFacts, Moments, Source, Split, concatenated
from app.data.blocks import batch_rows, block_stats, in_validation, rows
from app.data.class_names import decided, labels_text
from app.data.files import Located, locate
from app.data.schema import TABULAR, Spec, check_val_spec, image_spec, num_classes_of, schema_spec, totals
from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from app.config import TrainConfig

log = logging.getLogger(__name__)

# The preprocessed arrays exist up to this many times at once: the per-batch parts, the joined arrays,
# the train/validation split of them, and tf.data's constants made from those.
COPIES = 4
# ... and with the raw batches read, they may take at most this share of the memory available now.
MEMORY_SHARE = 0.8


def load(config: "TrainConfig", loc: Located) -> Source:
    """Checked train/validation arrays of a parquet, CSV, TFRecord or image-folder dataset (and --val-dataset)."""
    val_loc = locate(config.val_dataset, config.data_format) if config.val_dataset else None
    if val_loc is not None and val_loc.format != loc.format:
        raise UserError(f"--val-dataset is {val_loc.format} data but --dataset is {loc.format}: use one format")
    spec, (x, y, ids), total = _read_checked(loc, config)
    if val_loc is None:
        held = in_validation(ids, config.seed, config.val_fraction)
        whole = Split(x, y, ids)
        train, val = whole.rows(~held), whole.rows(held)
        if not len(train) or not len(val):
            raise UserError(f"val_fraction={config.val_fraction} leaves an empty train or val set for {len(y)} rows")
        label_max = total["label_max"]
    else:
        train = Split(x, y, ids)
        val_spec, (vx, vy, vids), val_total = _read_checked(val_loc, decided(config, spec))
        check_val_spec(spec, val_spec)
        val = Split(vx, vy, vids)
        label_max = max(total["label_max"], val_total["label_max"])
    num_classes = num_classes_of(config, spec, label_max)
    log.info(
        "dataset %s (%s, read in this process): %d training rows, %d validation rows, examples of shape %s, %s",
        loc.uri, loc.format, len(train), len(val), spec.input_shapes or spec.feature_shape,
        labels_text(num_classes, spec),
    )
    return Source(train, val, DataFacts(spec.feature_shape, spec.task, num_classes, len(train), len(val),
                                        input_shapes=spec.input_shapes,
                                        feature_moments=Moments.of(train.x) if spec.kind in TABULAR else None,
                                        label_moments=Moments.of_targets(train.y) if spec.task == "regression"
                                        else None, class_names=spec.classes if spec.label_names else ()))


def _read_checked(loc: Located, config: "TrainConfig"):
    """(final spec, (x, y, ids), totals): every batch read once, checked as a whole, then preprocessed."""
    import psutil

    spec = _spec(loc, config)
    known = _row_count(loc)  # None for CSV: its rows are counted as they are read
    budget = MEMORY_SHARE * psutil.virtual_memory().available
    tables: list["pa.Table"] = []
    stats, read, raw_bytes = [], 0, 0
    for table in batches(loc, config, spec):
        stats.append(block_stats(table, spec).to_pylist()[0])
        tables.append(table)
        read, raw_bytes = read + table.num_rows, raw_bytes + table.nbytes
        _check_fits(loc, known or read, read, raw_bytes, spec, budget)
    spec, total = totals(loc, config, spec, stats)
    parts = []
    while tables:  # each raw batch is let go once preprocessed
        parts.append(rows(tables.pop(0), spec))
    x, y, ids = (functools.reduce(concatenated, [p[i] for p in parts]) for i in range(3))
    return spec, (x, y, ids), total


def _check_fits(loc: Located, rows_total: int, read: int, raw_bytes: int, spec: Spec, budget: float) -> None:
    """Refuse data whose raw batches and preprocessed copies would not fit (estimated from the rows read)."""
    if not read:
        return
    # A list column's length is only known from the data: its raw values stand in for the float32 features.
    known = spec.kind == "named" and all(shape for _, shape in spec.inputs) or bool(spec.stored_shape)
    row_bytes = 4 * spec.values_per_row() if known else raw_bytes / read
    need = rows_total * (raw_bytes / read + COPIES * (row_bytes + 16))  # + y and id, 8 bytes each
    if need > budget:
        raise UserError(
            f"dataset {loc.uri!r} does not fit in memory for --backend local: {rows_total:,}"
            f"{'' if rows_total > read else '+'} rows need about {need / 2**30:,.1f} GiB, more than "
            f"{MEMORY_SHARE:.0%} of the {budget / MEMORY_SHARE / 2**30:,.1f} GiB available: train on it with "
            "--backend ray, which streams it"
        )


def _unreadable(loc: Located, error: Exception, path: Optional[str] = None) -> UserError:
    why = str(error).splitlines()[0] if str(error) else type(error).__name__
    return UserError(f"cannot read dataset {loc.uri!r} as {loc.format}: {f'{path}: ' if path else ''}{why}")


def file_schema(loc: Located) -> "pa.Schema":
    """The columns of parquet, CSV or TFRecord files: parquet's footer, CSV's header, the first TFRecord records."""
    try:
        if loc.format == "parquet":
            return _parquet(loc).schema
        if loc.format == "tfrecord":  # its features are in the records: the first batch's
            first = next(tfrecord.batches(loc, None, 64), None)
            if first is None:
                raise UserError(f"dataset {loc.uri!r} is empty: 0 rows")
            return first.schema
        with _csv_reader(loc, loc.files[0]) as reader:
            return reader.schema
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise _unreadable(loc, e) from None


def _spec(loc: Located, config: "TrainConfig") -> Spec:
    if loc.format == "images":
        return image_spec(loc, config)
    schema = file_schema(loc)
    spec = schema_spec(loc, config, schema)
    shape = _ray_tensor_shape(schema, spec)
    if shape and not config.feature_shape:  # the examples' shape a Ray run reads (Ray's type is not loaded here)
        spec = replace(spec, feature_shape=shape)
    return spec


def _ray_tensor_shape(schema, spec: Spec) -> tuple[int, ...]:
    """A tensor column Ray Data wrote: pyarrow without Ray reads it as flat lists; its field keeps the shape."""
    import json

    if spec.kind != "list":
        return ()
    meta = schema.field(spec.features[0]).metadata or {}
    if not meta.get(b"ARROW:extension:name", b"").startswith(b"ray.data.arrow_tensor"):
        return ()
    try:
        return tuple(int(n) for n in json.loads(meta[b"ARROW:extension:metadata"]))
    except (KeyError, ValueError, TypeError):
        return ()


def _row_count(loc: Located) -> Optional[int]:
    if loc.format == "parquet":
        return _parquet(loc).count_rows()  # from the files' metadata
    return len(loc.files) if loc.format == "images" else None


def _parquet(loc: Located):
    import pyarrow.dataset as pads

    return pads.dataset(list(loc.files), format="parquet", filesystem=loc.filesystem)


class _csv_reader:
    """pyarrow's streaming CSV reader of one file (batch by batch, as Ray Data's CSV reader), closed after."""

    def __init__(self, loc: Located, path: str):
        self.stream, self.path, self.loc = loc.filesystem.open_input_stream(path), path, loc

    def __enter__(self):
        import pyarrow.csv

        try:
            return pyarrow.csv.open_csv(self.stream)
        except Exception:
            self.stream.close()
            raise

    def __exit__(self, *exc) -> None:
        self.stream.close()


def batches(loc: Located, config: "TrainConfig", spec: Spec,
            columns: Optional[list[str]] = None) -> Iterator["pa.Table"]:
    """The raw rows, a batch at a time: parquet's and TFRecord's needed columns (``columns``, else the features
    and the label), whole CSV rows, decoded images."""
    import pyarrow as pa

    if loc.format == "images":
        yield from _image_batches(loc, config, spec)
        return
    path = None
    try:
        if loc.format == "tfrecord":
            yield from tfrecord.batches(loc, columns or [*spec.features, spec.label], batch_rows(spec))
            return
        if loc.format == "parquet":
            needed = columns or [*spec.features, spec.label]
            for batch in _parquet(loc).to_batches(columns=needed, batch_size=batch_rows(spec)):
                yield pa.Table.from_batches([batch])
            return
        for path in loc.files:
            with _csv_reader(loc, path) as reader:
                for batch in reader:
                    yield pa.Table.from_batches([batch])
    except (OSError, ValueError) as e:
        raise _unreadable(loc, e, path) from None


def _image_batches(loc: Located, config: "TrainConfig", spec: Spec) -> Iterator["pa.Table"]:
    """Images decoded as Ray Data's read_images does (app.data.images)."""
    import pyarrow as pa

    h, w = config.image_size
    mode = images.mode_of(spec.stored_shape)
    step = batch_rows(spec)
    for start in range(0, len(loc.files), step):
        paths = list(loc.files[start : start + step])
        pixels = []
        for path in paths:
            try:
                with loc.filesystem.open_input_file(path) as f:
                    pixels.append(images.decode(f.readall(), h, w, mode))
            except OSError as e:  # Pillow's UnidentifiedImageError is one
                raise _unreadable(loc, e, path) from None
        tensors = pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(pixels))
        yield pa.table({"image": tensors, "path": pa.array(paths)})
