"""A path of files or a ``ray.data.Dataset``, streamed into every worker's Keras fit, never read by the driver.

Driver (``prepare``): the files are located (app.data.files: local paths, ``s3://``, ``gs://``) or the Dataset
taken as it is; its schema says which columns are x and which is y, by the product's one rule
(app.data.schema: ``label_column`` is y when the data has that column, else the rows are x alone, as a model
with its own ``train_step`` may take them; ``feature_columns`` / ``inputs`` pick x); then its row count and its
first rows (one example's shapes and dtypes). Nothing else of the data reaches the driver: Ray Data reads the
files in its own tasks and turns every block into x / y columns there (app.data.blocks.keras_block).

Workers: Ray Train hands each worker a streaming split of that Dataset (``data_config``):

- training, ``equal=True``: every worker gets floor(rows / N) rows an epoch, so every worker runs the same
  number of steps, ceil(floor(rows / N) / b) with b = global batch / N rows per worker batch (the epoch's last
  batch is equally short on every worker; the all-reduce never waits for a missing peer). At most N - 1 rows an
  epoch are left out (``dropped_rows``), different ones each epoch when the input is shuffled;
- validation, ``equal=False``: every row scored once (a worker's evaluate() needs no step of the others: the
  metrics' states are summed over the workers at the epoch's end, app.training.keras_sync).

``worker_dataset`` turns one pass of the shard into a ``tf.data.Dataset`` that Keras's fit iterates once per
epoch (``from_generator`` over ``DataIterator.iter_batches``: one pass of the shard per iterator that is read,
with Ray Data's own prefetch and tf.data's; not ``iter_tf_batches``, which leaks threads every epoch:
ray-project/ray#62352). With ``shuffle``, files are dealt in a new seeded order every epoch and each worker mixes
rows in a seeded buffer of ``shuffle_buffer`` rows; a given Dataset keeps its blocks' order and is mixed in the
buffer alone.

What differs from one process on the same rows: a worker cuts its batches from its own shard, so a global batch
holds other rows than one process's batch of the same size would, and the epoch's short last batch has
N x ((rows // N) % b) rows where one process has rows % (N b). The gradients are still those of the mean loss
over every global batch's rows, and the metrics are summed over every row of the epoch
(tests/test_keras_stream.py).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from app.data.arrays import ID, Y, epoch_pass, x_of
from app.data.schema import Spec
from app.errors import UserError

if TYPE_CHECKING:
    import ray.data

    from app.config import TrainConfig

log = logging.getLogger(__name__)

# Batches Ray Data readies ahead of the step on each worker (its own threads), besides tf.data's prefetch.
PREFETCH_BATCHES = 4
# Rows read in the driver for one example's shapes and dtypes (and the plan's label check).
EXAMPLE_ROWS = 8


def is_ray_dataset(x: Any) -> bool:
    """A ``ray.data.Dataset``, told without importing Ray."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("ray.data") for c in type(x).__mro__)


def is_streamed(x: Any) -> bool:
    """An input streamed to the workers: a path of files (or URI) or a ``ray.data.Dataset``."""
    return isinstance(x, (str, os.PathLike)) or is_ray_dataset(x)


@dataclass
class StreamedKerasData:
    """One streamed fit() input as the workers read it: its columns' recipe, its size and how epochs cut it.

    The same questions as app.data.keras_inputs.KerasData answers for data in memory (``rows``: a few example
    rows, for the shapes), so the worker function and the plan treat both alike."""

    name: str  # Ray Train's name of the Dataset: "train" or "val"
    uri: str
    spec: Spec
    labelled: bool
    num_rows: int
    world: int
    batch: int  # rows of one worker's batch (the global batch / world)
    rows: Any  # the first rows, as (x,) or (x, y): one example's shapes and dtypes
    training: bool = True
    shuffle_buffer: int = 0  # rows of each worker's seeded mixing buffer (0: no shuffle)
    files_reshuffled: bool = False  # the files are dealt in a new seeded order every epoch
    cached: bool = False  # read once into Ray's object store (small data): each epoch a pass over its blocks
    holdout: Optional[tuple[str, float]] = None  # one side of a seeded validation split ("train"/"val", fraction)
    shared: str = ""  # why the files must be where every node sees them ("": one node, or a URI)
    # Keras's {class id: weight} (training only): each row's loss weighed by its label's class, by Keras's own
    # adapter of a tf.data input (validation stays unweighted, as in fit())
    class_weight: Optional[dict] = None
    audited: bool = False  # each row carries its id (ID column), for --audit-sample-ids
    shard: Any = field(default=None, repr=False)  # the worker's ray.data.DataIterator, bound on the worker

    streamed = True
    steps_per_epoch = None
    pipeline = None
    read_once = ""
    shuffle = False  # (KerasData's in-memory reshuffle; here the shard's order is Ray Data's)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "shard": None}

    @property
    def rows_per_worker(self) -> int:
        return self.num_rows // self.world if self.training else -(-self.num_rows // self.world)

    @property
    def steps(self) -> int:
        """Each worker's batches an epoch (the same on every worker, for training)."""
        return max(1, -(-self.rows_per_worker // self.batch))

    num_batches = steps

    def dropped_rows(self, world: int) -> int:
        return self.num_rows % world if self.training else 0

    def steps_on(self, world: int, epoch: int, seed: int) -> int:
        return self.steps

    def uneven_batches(self, world: int) -> bool:
        return False  # every global batch is world x the same worker batch

    def first_batch(self) -> Any:
        return self.rows

    def describe(self, what: str) -> str:
        """The plan's line: how this input streams and why."""
        how = (f"{what}: {self.uri}, streamed by Ray Data to the {self.world} worker(s) block by block "
               f"({'kept in the object store after its first read' if self.cached else 'read from its files every epoch'}"
               f"; the driver read its schema, count and first {EXAMPLE_ROWS} rows only); ")
        if self.training:
            how += (f"each worker takes floor({self.num_rows} / {self.world}) = {self.rows_per_worker} rows an epoch "
                    f"in batches of {self.batch}, so every worker runs {self.steps} steps")
            how += (f"; {self.dropped_rows(self.world)} row(s) an epoch are left out to keep the workers' steps equal"
                    if self.dropped_rows(self.world) else "")
            if self.shuffle_buffer:
                how += (f"; shuffled every epoch: {'the files in a new seeded order, ' if self.files_reshuffled else ''}"
                        f"rows mixed in a seeded buffer of {self.shuffle_buffer} on each worker")
            if self.class_weight:
                how += "; each row's loss weighed by its class (class_weight)"
        else:
            how += "every row scored once, each worker scoring its part"
        if self.holdout is not None:
            how += (f"; the rows of the seeded {self.holdout[1]:g} validation split (val_fraction: this data set has "
                    f"no validation part), {'held out of training' if self.holdout[0] == 'train' else 'scored'}")
        return how + ("" if self.labelled else f"; no {self.spec.label!r} column: the rows are x alone") + self.shared

    def worker_dataset(self, epochs: range, seed: int, rank: int, world: int, training: bool,
                       record: Optional[Callable[[np.ndarray], Any]] = None):
        """One pass of this worker's shard as a ``tf.data.Dataset`` fit() iterates once per epoch, and
        ``choose(epoch)`` (call it when the epoch begins), which seeds that epoch's mixing buffer. ``record``: handed
        the ids of each batch's rows as fit() reads it (``audited`` data only)."""
        import tensorflow as tf

        if self.shard is None:
            raise RuntimeError(f"the {self.name!r} shard of this worker was not bound (StreamedKerasData.shard)")
        shard, names, chosen = self.shard, self.spec.input_shapes, {"epoch": epochs.start}
        mixing = self.shuffle_buffer if training else 0

        def one_pass():
            # Runs when fit() reads the epoch's iterator (an iterator made and not read never touches the shard).
            shuffle = {"local_shuffle_buffer_size": mixing,
                       "local_shuffle_seed": (seed * 1_000_003 + chosen["epoch"]) % 2**31} if mixing else {}
            for batch in shard.iter_batches(batch_size=self.batch, batch_format="numpy", drop_last=False,
                                            prefetch_batches=PREFETCH_BATCHES, **shuffle):
                x = x_of(batch, names)
                if record is not None:
                    record(batch[ID])
                yield (x, batch[Y]) if self.labelled else (x,)

        signature = tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)),
                                          self.rows)
        ds = tf.data.Dataset.from_generator(one_pass, output_signature=signature)
        if self.training:  # fit() knows an epoch's steps; a shard that gives other than planned raises, not hangs
            ds = ds.apply(tf.data.experimental.assert_cardinality(self.steps))
        if self.training and self.class_weight:
            from app import internals

            ds = internals.keras_data_adapter(ds, None, None, None, None, self.class_weight).get_tf_dataset()
        return epoch_pass(ds), lambda epoch: chosen.update(epoch=epoch)


def locate_input(x: Any, config: "TrainConfig"):
    """The files behind a path (or a given Dataset), their format told once (app.data.files)."""
    from app.data.files import given_dataset, locate

    if is_ray_dataset(x):
        return given_dataset("a ray.data.Dataset", x)
    return locate(os.fspath(x), config.data_format)


def inspect(loc, config: "TrainConfig", what: str) -> tuple[Spec, bool, int, Any]:
    """Schema -> (spec, labelled, row count, the first rows as a pyarrow Table): the driver's whole read."""
    from app.data import streamed
    from app.data.blocks import _lengths, _with_lengths
    from app.data.class_names import with_class_names
    from app.data.schema import image_spec, schema_spec, with_feature_shape

    if loc.format == "numpy":
        raise UserError(f"{what}: numpy files are not streamed; load them with numpy.load and give the arrays")
    raw = streamed.read(loc, config)
    if loc.format == "images":
        spec, labelled = image_spec(loc, config), True
    else:
        try:
            schema = raw.schema()
        except Exception as e:
            raise streamed._unreadable(loc, e) from None
        if schema is None:
            raise UserError(f"{what} {loc.uri!r} is empty: 0 rows")
        labelled = config.label_column in schema.names
        spec = schema_spec(loc, config, schema, labelled=labelled)
    raw = _projected(raw, loc, spec, labelled)
    try:
        if spec.label_names:  # one pass over the label column: the names' ids decided (or checked) before any worker
            spec = with_class_names(spec, raw.unique(spec.label), f"{what} {loc.uri!r}")
        rows = raw.count()
        first = raw.take_batch(EXAMPLE_ROWS, batch_format="pyarrow") if rows else None
    except Exception as e:
        if not any(marker in str(e) for marker in streamed._UNREADABLE):
            raise
        raise streamed._unreadable(loc, e) from None
    if not rows:
        raise UserError(f"{what} {loc.uri!r} is empty: 0 rows")
    lengths = {k: low for k, (low, high) in _lengths(first, spec).items()}
    spec = _with_lengths(spec, lengths)
    if spec.kind != "named" and config.feature_shape:  # each example reshaped, as the statistics pass does
        spec = with_feature_shape(spec, config)
    return spec, labelled, rows, first


def _projected(raw: "ray.data.Dataset", loc, spec: Spec, labelled: bool) -> "ray.data.Dataset":
    """Only the columns the model reads (pushed into parquet's read)."""
    from app.data.streamed import PROJECTED

    if loc.format not in PROJECTED:
        return raw
    return raw.select_columns([*spec.features, *([spec.label] if labelled else [])])


def check_batch(batch_size: int, world: int, what: str) -> None:
    """A streamed input's global batch is cut into equal worker batches."""
    if batch_size % world:
        below, above = batch_size // world * world, (batch_size // world + 1) * world
        raise UserError(f"batch_size {batch_size} is the global batch and a streamed {what} is cut into equal worker "
                        f"batches: it must divide over the {world} workers (use {below or above} or {above})")


def check_weighed(class_weight: Any, labelled: bool, config: "TrainConfig") -> None:
    """class_weight weighs rows by their label: a streamed input without its label column has none to weigh."""
    if class_weight is not None and not labelled:
        raise UserError(f"class_weight weighs the rows by their label, but x has no {config.label_column!r} column: "
                        "give label_column the column that holds the class ids, or leave class_weight out")


def prepare(loc, config: "TrainConfig", *, name: str, what: str, batch_size: int, world: int, shuffle: bool,
            training: bool, holdout: Optional[tuple[str, float]] = None,
            class_weight: Optional[dict] = None) -> tuple[StreamedKerasData, "ray.data.Dataset"]:
    """A located streamed input (``locate_input``), checked and described (``inspect``), and its Ray Dataset of
    x / y columns (Ray must be connected: the checks read the schema and the count through Ray Data).
    ``holdout`` ("train" or "val", fraction): one side of the seeded split of a data set with no validation part
    (the command line's ``--val-fraction``), its rows counted by one more pass of Ray Data's tasks.
    ``class_weight``: Keras's {class id: weight} for training rows (checked against the schema before any pass)."""
    from app.data import streamed
    from app.data.blocks import batch_rows, keras_block, keras_rows

    check_batch(batch_size, world, what)
    spec, labelled, rows, first = inspect(loc, config, what)
    check_weighed(class_weight, labelled, config)
    if training and rows < world:
        raise UserError(f"{what} has {rows} rows, fewer than the {world} workers: use fewer workers")
    audited = training and config.audit_sample_ids  # the rows' ids streamed beside them
    x_first, y_first = keras_rows(first, spec, labelled)
    example = (x_first,) if y_first is None else (x_first, y_first)
    # Small enough for the object store (the product's one rule, app.data.streamed): read once into it, every
    # epoch a pass over its blocks; else read from the files every epoch, block by block, a bounded window ahead.
    cached = streamed._fits_in_memory(config, rows, spec, "training" if training else "validation")
    reshuffled = training and shuffle and loc.format != "ray-dataset" and not cached
    with nullcontext() if cached else streamed.streaming(config), _in_order(not (training and shuffle)):
        ds = _projected(streamed.read(loc, config, None, config.seed if reshuffled else None), loc, spec, labelled)
        ds = ds.map_batches(keras_block, batch_format="pyarrow", batch_size=batch_rows(spec),
                            fn_kwargs={"spec": spec, "labelled": labelled, "holdout": holdout, "ids": audited})
    if cached:
        ds = ds.materialize()
    if holdout is not None:
        rows = ds.count()
        if training and rows < world:
            raise UserError(f"{what}: val_fraction={holdout[1]} leaves {rows} training rows for {world} workers")
        if not rows:
            raise UserError(f"{what}: val_fraction={holdout[1]} leaves no validation rows: raise it")
    data = StreamedKerasData(name, loc.uri, spec, labelled, rows, world, batch_size // world, example,
                             training=training, shuffle_buffer=config.shuffle_buffer if training and shuffle else 0,
                             files_reshuffled=reshuffled, cached=cached, holdout=holdout,
                             shared=_shared(loc), class_weight=dict(class_weight) if class_weight else None,
                             audited=audited)
    return data, ds


@contextmanager
def _in_order(wanted: bool):
    """Datasets made inside keep the rows in the files' order (``shuffle=False``: one worker then trains on the
    rows as ``model.fit(shuffle=False)`` on them in that order would)."""
    from ray.data import DataContext

    options = DataContext.get_current().execution_options
    saved = options.preserve_order
    options.preserve_order = saved or wanted
    try:
        yield
    finally:
        options.preserve_order = saved


def _shared(loc) -> str:
    """On a cluster of several nodes, a local path is read by Ray Data's tasks wherever they run: it must be on
    storage every node mounts at that path (a task on a node without it fails, naming the file)."""
    import ray

    if loc.format == "ray-dataset" or "://" in loc.uri or sum(n["Alive"] for n in ray.nodes()) < 2:
        return ""
    return (f"; {loc.uri} is a local path and this cluster has several nodes: Ray Data reads it on any of them, so "
            "it must be on shared storage mounted at that path everywhere (or give an s3:// or gs:// URI)")


def read_local(x: Any, config: "TrainConfig", what: str) -> tuple[Any, Optional[np.ndarray], Spec]:
    """A path read in this process (the local backend: one process, no Ray Data), as x and y arrays (and the spec
    of its columns)."""
    import pyarrow as pa

    from app.data import local_files
    from app.data.blocks import _lengths, _with_lengths, keras_rows
    from app.data.class_names import distinct, with_class_names
    from app.data.schema import image_spec, schema_spec

    if is_ray_dataset(x):
        raise UserError(f"{what} is a ray.data.Dataset, which trains on Ray workers: leave out backend='local'")
    loc = locate_input(x, config)
    if loc.format == "numpy":
        raise UserError(f"{what}: numpy files are not streamed; load them with numpy.load and give the arrays")
    if loc.format == "images":
        spec, labelled, columns = image_spec(loc, config), True, None
    else:
        schema = local_files.file_schema(loc)
        labelled = config.label_column in schema.names
        spec = schema_spec(loc, config, schema, labelled=labelled)
        columns = None if loc.format == "csv" else [*spec.features, *([spec.label] if labelled else [])]
    tables = list(local_files.batches(loc, config, spec, columns))
    if not tables or not sum(t.num_rows for t in tables):
        raise UserError(f"{what} {loc.uri!r} is empty: 0 rows")
    table = pa.concat_tables(tables)
    spec = _with_lengths(spec, {k: low for k, (low, high) in _lengths(table, spec).items()})
    if spec.label_names:
        spec = with_class_names(spec, distinct(table, spec.label), f"{what} {loc.uri!r}")
    return (*keras_rows(table, spec, labelled), spec)


def data_config(datasets: dict[str, "ray.data.Dataset"]):
    """Ray Train's DataConfig for streamed Keras inputs: "train" split ``equal=True`` (the same steps on every
    worker), "val" ``equal=False`` (every row scored once); each keeps the execution options it was made with
    (app.data.streamed.streaming's bounded read-ahead)."""
    import ray.train

    options = {name: ds.context.execution_options for name, ds in datasets.items()}

    class KerasDataConfig(ray.train.DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                ds = ds.copy(ds)
                ds.context.execution_options = options[name]
                for i, split in enumerate(ds.streaming_split(world_size, equal=name == "train")):
                    output[i][name] = split
            return output

    return KerasDataConfig()
