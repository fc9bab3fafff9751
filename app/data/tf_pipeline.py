"""A ``tf.data.Dataset`` given to ``app.fit``, run again every epoch on every worker, as Keras's fit runs it.

Keras's fit iterates a dataset anew each epoch: its ``shuffle`` reshuffles and a
random ``map`` (augmentation) draws again. To do the same on every worker, the
driver serialises the pipeline's graph (TensorFlow's own ``DatasetToGraph``, what
tf.data service ships to its workers), and each worker rebuilds it
(``DatasetFromGraph``), iterates it once per epoch and trains on its part of
every batch (app.data.keras_inputs). Every worker must then see the same batches
in the same order, so the pipeline must be the same everywhere:

- a ``shuffle`` with no seed draws a new seed in each process: its seed is set
  here from the run's seed, the same on every worker (each epoch still
  reshuffles, as with any seeded ``shuffle``);
- parallel ``map``/``interleave`` keep their order (``deterministic``);
- a pipeline whose batches could differ between processes is read once in the
  driver instead (``why_read_once``): one that calls Python (``from_generator``,
  ``py_function``: not serialisable), reads a variable or a lookup table (its
  state stays in the driver), caches to a file, or picks elements at random
  (``sample_from_datasets``, a random ``filter``, a ``shuffle`` inside an
  ``interleave``).

A pipeline that reads files (``TFRecordDataset``, ``list_files`` + ``interleave``,
``TextLineDataset``: ``files``) is never read by the driver but for its first
batch: every worker reads the files itself, every epoch (they must be where every
worker sees them: shared storage, or ``gs://`` / ``s3://`` URIs that TensorFlow
reads), and so a data set of any size trains in bounded memory.

A random op in a ``map`` is serialised as an op, not as its state: each worker
draws its own augmentation for its own rows, once per epoch, as one Keras process
draws it for every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MAX_GRAPH_BYTES = 256 << 20  # a pipeline over in-memory arrays holds them as constants: beyond, read once

_PYTHON = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "GeneratorDataset"}
_FILES = {"TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
          "FixedLengthRecordDatasetV2", "MatchingFiles", "MatchingFilesDataset", "ReadFile", "LoadDataset",
          "SnapshotDataset", "SnapshotDatasetV2", "SnapshotDatasetReader", "ListFiles"}
_STATE = ("Variable", "LookupTable", "HashTable", "ResourceGather")
_RANDOM_CHOICE = {"RandomDataset", "RandomDatasetV2", "ExperimentalRandomDataset", "SamplingDataset",
                  "ExperimentalSamplingDataset"}
_SHUFFLES = {"ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3", "ShuffleAndRepeatDataset",
             "ShuffleAndRepeatDatasetV2"}
_RANDOM_OPS = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomShuffle", "Multinomial",
               "StatefulUniform", "StatefulStandardNormal", "StatefulTruncatedNormal", "StatefulRandomBinomial",
               "RandomGamma", "RandomPoisson")


@dataclass(frozen=True)
class Pipeline:
    """A dataset's serialised graph and element spec: rebuilt, it yields the batches the user's dataset yields."""

    graph: bytes
    spec: Any  # the dataset's element_spec (TensorSpecs pickle)
    files: tuple[str, ...] = ()  # the local files it reads, named in its graph (a file source's constants)

    def dataset(self, seed: int):
        """The pipeline, rebuilt in this process, its unseeded shuffles seeded from ``seed``, its shuffles at their
        first pass and its order kept."""
        import tensorflow as tf

        graph = _seeded(self.graph, seed)
        ds = tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph), self.spec)
        options = tf.data.Options()
        options.deterministic = True
        return ds.with_options(options)


def serialise(ds: Any) -> tuple[Optional[Pipeline], str]:
    """(the pipeline, "") when every worker can run ``ds`` again every epoch, else (None, why it is read once)."""
    import tensorflow as tf

    if ds.cardinality() == tf.data.INFINITE_CARDINALITY:
        return None, "it repeats without end"
    if any(s.shape.rank == 0 for s in tf.nest.flatten(ds.element_spec)):
        return None, "its elements are not batches (a part of them is a single value)"
    try:
        # IGNORE: a random op is kept as an op (each process draws anew); the checks below refuse the state that
        # would be lost (variables, tables, Python).
        graph = ds._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy()
    except (tf.errors.OpError, ValueError, TypeError) as e:
        return None, f"TensorFlow cannot serialise it ({' '.join(str(e).split())[:120]})"
    if len(graph) > MAX_GRAPH_BYTES:
        return None, f"its graph (its in-memory data included) is over {MAX_GRAPH_BYTES >> 20} MiB"
    why = why_read_once(graph)
    return (None, why) if why else (Pipeline(graph, ds.element_spec, files_read(graph)), "")


def why_read_once(graph: bytes) -> str:
    """Why a serialised pipeline could give different batches in different processes ("" when it cannot)."""
    import tensorflow as tf

    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(graph)
    top = [n.op for n in gd.node]
    inner = [n.op for f in gd.library.function for n in f.node_def]
    ops = set(top) | set(inner)
    if ops & _PYTHON:
        return "it calls Python (from_generator or py_function), which does not leave this process"
    if _cache_file(gd):
        return "it caches to a file, which every worker would write"
    if any(word in op for op in ops for word in _STATE):
        return "it reads a variable or a lookup table, whose state stays in this process"
    if ops & _RANDOM_CHOICE or set(inner) & _SHUFFLES or _random_filter(gd):
        return "it picks elements at random (sample_from_datasets, a random filter or a shuffle inside a function)"
    return ""


def files_read(graph: bytes) -> tuple[str, ...]:
    """The file names a pipeline that reads files holds as constants (TFRecordDataset(["a", "b"]), list_files'
    pattern), or ("?",) when it reads files named otherwise (computed in the graph); () when it reads none."""
    import tensorflow as tf

    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(graph)
    ops = {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}
    if not ops & _FILES:
        return ()
    names = []
    for n in gd.node:
        if n.op == "Const" and n.attr["value"].tensor.dtype == tf.string.as_datatype_enum:
            values = [v.decode(errors="replace") for v in n.attr["value"].tensor.string_val]
            names += [v for v in values if "/" in v or "." in v]
    return tuple(dict.fromkeys(names)) or ("?",)


def _cache_file(gd) -> bool:
    """A ``cache(filename)`` (a ``cache()`` in memory has an empty filename)."""
    import tensorflow as tf

    consts = {n.name: n for n in gd.node if n.op == "Const"}
    for n in gd.node:
        if n.op.startswith("CacheDataset") and len(n.input) > 1:
            name = consts.get(n.input[1].split(":")[0])
            if name is None or tf.make_ndarray(name.attr["value"].tensor).item():
                return True
    return False


def _random_filter(gd) -> bool:
    """A ``filter`` whose predicate draws random numbers: which elements pass differs from process to process."""
    functions = {f.signature.name: f for f in gd.library.function}
    for n in gd.node:
        if n.op.startswith("FilterDataset"):
            predicate = functions.get(n.attr["predicate"].func.name)
            if predicate is not None and any(op.op.startswith(_RANDOM_OPS) for op in predicate.node_def):
                return True
    return False


def _seeded(graph: bytes, seed: int) -> bytes:
    """The graph with every unseeded shuffle (seed and seed2 both 0: TensorFlow then draws them per process)
    given seeds from the run's ``seed``, the same in every process, and every shuffle's seed generator a new one:
    rebuilt in the process that made the dataset, it would otherwise share the original's, moved on by every pass
    already made of it (the driver's read)."""
    import uuid

    import tensorflow as tf

    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(graph)
    consts = {n.name: n for n in gd.node if n.op == "Const"}
    for i, n in enumerate(n for n in gd.node if n.op in _SHUFFLES):
        seeds = [consts.get(name.split(":")[0]) for name in n.input[2:4]]
        if None in seeds or any(tf.make_ndarray(s.attr["value"].tensor).item() for s in seeds):
            continue
        for s, value in zip(seeds, (seed + 1, i + 1)):
            s.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int64))
    fresh = uuid.uuid4().hex
    for n in consts.values():
        for handle in n.attr["value"].tensor.resource_handle_val:
            if "SeedGenerator" in handle.maybe_type_name:
                handle.name = f"{handle.name}-{fresh}"
    return gd.SerializeToString()
