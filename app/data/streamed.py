"""File datasets on Ray Data: schema checks, one statistics pass, then preprocessed Ray Datasets for the workers.

parquet, CSV, TFRecord and image folders are read by Ray Data block by block
(``read_parquet`` / ``read_csv`` / ``read_tfrecords`` / ``read_images``, which take local paths and
``s3://`` / ``gs://`` URIs) and ``map_batches`` turns each block into the
columns every worker consumes (app.data.blocks). The driver never holds the
data: it sees the schema, a few numbers per block from one statistics pass,
and file names. Every check runs before any output directory or worker exists.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

from app.data import tfrecord
from app.data.arrays import DataFacts
from app.data.blocks import batch_rows, block_stats, preprocess
from app.data.class_names import decided, labels_text
from app.data.files import Located, locate
from app.data.ray_input import padded, shuffled_each_epoch
from app.data.schema import Spec, check_val_spec, image_spec, num_classes_of, schema_spec, totals
from app.errors import UserError

if TYPE_CHECKING:
    import ray.data

    from app.config import TrainConfig

log = logging.getLogger(__name__)

# Preprocessed data is kept in the object store ("memory") when it takes at most
# this share of it: the rest is left for Ray Data's in-flight blocks and the
# workers' own objects.
CACHE_SHARE = 0.3
# Blocks of streamed data. Ray Data's default (128 MiB) is made for throughput
# over big clusters; here a block is what a worker maps and batches at a time and
# the unit of the read-ahead budget (--stream-buffer-mib), so a few MiB keeps
# both small and steady from the first blocks on, at any dataset size.
STREAM_BLOCK_BYTES = 16 << 20
# Sources whose reads keep only the needed columns (pushed into parquet's read; the others drop the rest
# right after it, in the same task).
PROJECTED = ("parquet", "ray-dataset", "tfrecord")


@dataclass
class Streamed:
    """Ray Datasets ready for the Ray Train run (app.backends.ray_train), and the numbers the workers need."""

    train: "ray.data.Dataset"
    val: "ray.data.Dataset"
    facts: DataFacts
    shuffle_buffer: int  # rows of each worker's local shuffle buffer (0: the dataset is shuffled globally)
    cached: dict[str, bool] = field(default_factory=dict)
    streamed = True  # as opposed to app.data.arrays.Source

    # The facts, by name (as in-memory data's Split lengths and shapes read).
    feature_shape = property(lambda self: self.facts.feature_shape)
    num_classes = property(lambda self: self.facts.num_classes)
    num_train_rows = property(lambda self: self.facts.num_train_rows)
    num_val_rows = property(lambda self: self.facts.num_val_rows)


def read(loc: Located, config: "TrainConfig", spec: Optional[Spec] = None, shuffle_seed: Optional[int] = None):
    """The raw Ray Dataset of a file source; with ``shuffle_seed``, the file order is reshuffled every epoch."""
    import ray.data
    from ray.data import FileShuffleConfig

    if loc.format == "ray-dataset":
        return loc.dataset if spec is None else loc.dataset.select_columns([*spec.features, spec.label])
    common: dict[str, Any] = {"filesystem": loc.filesystem}
    if shuffle_seed is not None:
        common["shuffle"] = FileShuffleConfig(seed=shuffle_seed, reseed_after_execution=True)
    files = list(loc.files)
    try:
        if loc.format == "parquet":
            with _listed_once():
                ds = ray.data.read_parquet(files, **common)
            # Only the needed columns are read from the files (the projection is pushed into the read).
            return ds if spec is None else ds.select_columns([*spec.features, spec.label])
        if loc.format == "csv":
            return ray.data.read_csv(files, **common)
        if loc.format == "tfrecord":
            # Its reader imports TensorFlow in each read task's process (a few seconds, once per process).
            ds = ray.data.read_tfrecords(files, **common)
            return ds if spec is None else ds.select_columns([*spec.features, spec.label])
        if loc.format == "images":
            h, w = config.image_size
            mode = "RGB" if config.image_channels == 3 else "L"
            return ray.data.read_images(files, size=(h, w), mode=mode, include_paths=True, **common)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read dataset {loc.uri!r} as {loc.format}: {str(e).splitlines()[0]}") from None
    raise UserError(f"dataset {loc.uri!r}: format {loc.format!r} is not streamed")


@contextmanager
def _listed_once():
    """Parquet read by Ray Data's first datasource, which reads the files' footers once, where the dataset is made.
    Its default in ray 2.60 (DataSourceV2) lists them again on every execution, i.e. every epoch of a streamed
    input, on a pool of new FooterReader actors (32 by default, each a process started for the listing): seconds
    of every epoch on a small cluster (BENCHMARKS.md, streaming). The same rows, columns and seeded file order."""
    from ray.data import DataContext

    context = DataContext.get_current()
    saved, context.use_datasource_v2 = context.use_datasource_v2, False
    try:
        yield
    finally:
        context.use_datasource_v2 = saved


# What Ray Data and pyarrow say of a file they cannot parse, and a check of app.data.blocks that failed
# inside a Ray Data task (its UserError's line is the message).
_UNREADABLE = ("Failed to read", "ArrowInvalid", "ArrowTypeError", "parse error", "Invalid:", "failed to parse",
               "Failed to unify", "UserError: ")
# Lines that name the column and the fix themselves: not prefixed with "cannot read dataset".
_OWN_LINE = ("feature column ", "label column ")

# "ValueError: message", "pyarrow.lib.ArrowInvalid: message": the exception lines of a Ray task's error text.
_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Invalid): ")


def _read_failure(loc: Located, error: Exception) -> str:
    """The reason a read failed, in a line: the innermost exception's message, not Ray's traceback.

    Ray Data reports a CSV that does not parse as "Failed to read CSV file: <path>";
    for a local file, pyarrow's own parser then names the row and what is wrong with it.
    """
    if loc.format == "tfrecord" and (why := tfrecord.read_failure(str(error))):
        return why
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # A check of app.data.blocks that failed in a task is the reason, whatever Ray Data wrapped it in.
    raised = [line for line in lines if line.startswith(("UserError: ", "app.errors.UserError: "))] or \
        [line for line in lines if _RAISED.match(line)]
    message = _RAISED.sub("", raised[-1] if raised else (lines[0] if lines else type(error).__name__))
    named = re.search(r"Failed to read CSV file: (.+?)\. Please check", message)
    if loc.format == "csv" and named and os.path.isfile(named.group(1)):
        import pyarrow.csv

        try:
            for _ in pyarrow.csv.open_csv(named.group(1)):  # batch by batch: never the whole file in memory
                pass
        except Exception as why:
            return f"{named.group(1)}: {why}".splitlines()[0]
    return message


def _inspect(loc: Located, config: "TrainConfig", val_fraction: Optional[float]) -> tuple[Spec, dict[str, int]]:
    """Schema checks, then one streaming statistics pass; returns the final spec and the totals."""
    if loc.format == "images":
        spec = image_spec(loc, config)
    else:
        raw = read(loc, config)
        try:
            schema = raw.schema()
        except Exception as e:
            raise _unreadable(loc, e) from None
        if schema is None:
            raise UserError(f"dataset {loc.uri!r} is empty: 0 rows")
        spec = schema_spec(loc, config, schema)
    spec = replace(spec, val_fraction=val_fraction)

    with streaming(config):
        per_block = read(loc, config, spec if loc.format in PROJECTED else None).map_batches(
            block_stats, batch_format="pyarrow", batch_size=batch_rows(spec), fn_kwargs={"spec": spec}
        )
    try:
        stats = per_block.take_all()
    except Exception as e:
        if not any(marker in str(e) for marker in _UNREADABLE):
            raise
        raise _unreadable(loc, e) from None
    return totals(loc, config, spec, stats)


def _unreadable(loc: Located, error: Exception) -> UserError:
    why = _read_failure(loc, error)
    return UserError(why if why.startswith(_OWN_LINE) else f"cannot read dataset {loc.uri!r} as {loc.format}: {why}")


def _fits_in_memory(config: "TrainConfig", rows: int, spec: Spec, what: str) -> bool:
    import ray

    row_bytes = 4 * spec.values_per_row() + 8 + 8 + 4  # x float32, y, id, w
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


def built_in_facts(config: "TrainConfig", given: Optional[Located] = None) -> DataFacts:
    """What a built-in model is built for, of a streamed ``--dataset`` (or a given Ray Dataset) and ``--val-dataset``:
    the schema checks and the one statistics pass ``prepare`` makes (Ray Data's tasks read the rows; the driver gets
    a few numbers per block), the classes from the largest label of both. Without ``--val-dataset`` the run holds
    out the seeded ``val_fraction`` (app.run.config_run), so the training rows' moments leave those rows out, as
    ``prepare``'s do. Ray must be connected."""
    loc = given or locate(config.dataset, config.data_format)
    spec, stats = _inspect(loc, config, None if config.val_dataset else config.val_fraction)
    if config.val_dataset:
        val_loc = locate(config.val_dataset, config.data_format)
        if val_loc.format != loc.format:
            raise UserError(f"--val-dataset is {val_loc.format} data but --dataset is {loc.format}: use one format")
        val_spec, val_stats = _inspect(val_loc, decided(config, spec), None)
        check_val_spec(spec, val_spec)
        stats["label_max"] = max(stats["label_max"], val_stats["label_max"])
    return DataFacts(spec.feature_shape, spec.task, num_classes_of(config, spec, stats["label_max"]),
                     stats["rows"] - stats["val_rows"], stats["val_rows"],
                     input_shapes=spec.input_shapes, streamed=True, feature_moments=stats["moments"],
                     label_moments=stats["label_moments"], class_names=spec.classes if spec.label_names else ())


def prepare(config: "TrainConfig", num_workers: int, given: Optional[Located] = None) -> Streamed:
    """Check a file source (or a given Ray Dataset) and build its train/val Ray Datasets.

    Ray must be running: the checks read the data.
    """
    loc = given or locate(config.dataset, config.data_format)
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
        val_spec, val_stats = _inspect(val_loc, decided(config, spec), None)
        check_val_spec(spec, val_spec)
        n_train, n_val = stats["rows"], val_stats["rows"]
        stats["label_max"] = max(stats["label_max"], val_stats["label_max"])
    num_classes = num_classes_of(config, spec, stats["label_max"])

    def pipeline(source: Located, s: Spec, keep: str, weights: bool, shuffle_seed: Optional[int], streamed: bool):
        with streaming(config) if streamed else nullcontext():
            raw = read(source, config, s if source.format in PROJECTED else None, shuffle_seed)
            return raw.map_batches(
                preprocess, batch_format="pyarrow", batch_size=batch_rows(s),
                fn_kwargs={"spec": s, "keep": keep, "weights": weights},
            )

    train_keep = "train" if val_loc is None else "all"
    cached = {"train": _fits_in_memory(config, n_train, spec, "training")}
    if cached["train"]:
        train = pipeline(loc, spec, train_keep, False, None, streamed=False).materialize()
        if config.shuffle:
            train = shuffled_each_epoch(train, config.seed)
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
    facts = DataFacts(spec.feature_shape, spec.task, num_classes, n_train, n_val, input_shapes=spec.input_shapes,
                      streamed=True, feature_moments=stats["moments"], label_moments=stats["label_moments"],
                      class_names=spec.classes if spec.label_names else ())
    val = padded(val, n_val, num_workers, facts)
    log.info(
        "dataset %s (%s): %d training rows, %d validation rows, examples of shape %s, %s",
        loc.uri, loc.format, n_train, n_val, spec.input_shapes or spec.feature_shape,
        labels_text(num_classes, spec),
    )
    return Streamed(train, val, facts, shuffle_buffer, cached)


@contextmanager
def streaming(config: "TrainConfig"):
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
      (python jobs/benchmark.py memory: the budget alone, with 128 MiB blocks, did
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
    """Ray Train's DataConfig: streamed datasets keep their own execution options (``streaming``).

    Without it Ray Train replaces every dataset's options with the driver's
    current defaults. Cached datasets are already whole in the store: they
    keep Ray Train's defaults.
    """
    import ray.train

    options = {name: ds.context.execution_options for name, ds in datasets.items() if not cached[name]}
    return ray.train.DataConfig(execution_options=options or None)
