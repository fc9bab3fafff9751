"""Whatever ``model.fit`` takes as x, y and validation_data, read as fit() reads it, then cut over the workers.

The driver reads each input once through Keras's own data adapter (arrays,
dicts and lists of arrays, ``tf.data.Dataset`` of any element structure, a
``keras.utils.PyDataset``, a generator; ``class_weight`` turned into sample
weights as fit() does), unshuffled: ``KerasData`` holds the rows of every
batch, one array per leaf of the element structure the model's step unpacks
(``(x,)``, ``(x, y)``, ``(x, y, sample_weight)``, with dicts or lists inside),
and where each batch begins.

An epoch is a list of global batches, the same on every worker:
- arrays: ``batch_size`` rows at a time, the rows reshuffled every epoch from
  the run's seed when ``shuffle`` (as fit() reshuffles arrays), the last batch
  short;
- a dataset, PyDataset or generator: its batches as the user batched them, in
  their order (a PyDataset's order reshuffled when ``shuffle``, as fit() does);
  with ``steps_per_epoch``, each epoch goes on where the last one stopped.
Worker r of N takes rows [r n / N, (r + 1) n / N) of each global batch of n
rows (what a Keras strategy gives a replica), so every row is seen once per
epoch across the workers and every worker runs the same number of steps. A
global batch of fewer rows than workers cannot be cut so: it is left out of
training (``dropped_rows`` says how many; the plan prints it).

A training ``tf.data.Dataset`` is moreover run again every epoch on every
worker when it can be (app.data.tf_pipeline): its ``shuffle`` reshuffles and
its random ``map`` draws anew each epoch, as in Keras's fit, and each worker
takes its part of every batch as above. Otherwise (a pipeline that reads files
or calls Python, a PyDataset, a generator, validation data) what the driver
read is what trains: a dataset's own ``map`` and ``shuffle`` ran once, and
random augmentation was drawn once (``MAX_BYTES`` bounds what is held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from app import internals
from app.data.arrays import epoch_pass
from app.data.checks import refuse_unreadable
from app.data.tf_datasets import MAX_BYTES, is_tf_dataset
from app.data.tf_pipeline import Pipeline, serialise
from app.errors import UserError, users_file, words_of


def keras_passes_before(epoch: int, counted: bool) -> int:
    """How many iterators of a dataset Keras 3.15's fit has made before epoch ``epoch`` (from 0) starts: each one
    moves the dataset's shuffles on by a pass, read or not. When fit knows the dataset's number of batches
    (``counted``), ``_enumerate_iterator`` (keras/src/trainers/epoch_iterator.py) makes one when an epoch ends and
    another when the next begins, so epoch e reads pass 2e; when it does not, one per epoch, read to its end.
    (tests/test_keras_step_local.py: whole and resumed runs of either kind equal model.fit.)"""
    return 2 * epoch if counted else epoch


@dataclass
class KerasData:
    """One fit() input: the rows of its batches (a structure of arrays) and how epochs cut them."""

    rows: Any  # the element structure, each leaf an array of every row
    bounds: np.ndarray  # batch b is rows [bounds[b], bounds[b + 1]) (before any shuffle)
    batch_size: Optional[int]  # arrays: rows per batch (reshuffled rows are cut anew each epoch); else None
    shuffle: Any = False  # arrays: rows each epoch; a PyDataset: its batches' order
    steps_per_epoch: Optional[int] = None  # batches per epoch when the user set it
    pipeline: Optional[Pipeline] = None  # a tf.data.Dataset every worker runs again each epoch
    read_once: str = ""  # why a tf.data.Dataset is not (the plan says it)
    counted: bool = True  # False: a pipeline that reads files; ``rows`` holds its first batch only, and its rows
    # and batches are counted as the workers run it (num_rows, steps: None)
    ids: Optional[np.ndarray] = None  # each row's id (--audit-sample-ids); None: its position in ``rows``

    @property
    def num_rows(self) -> Optional[int]:
        return int(self.bounds[-1]) if self.counted else None

    @property
    def num_batches(self) -> Optional[int]:
        return len(self.bounds) - 1 if self.counted else None

    @property
    def steps(self) -> Optional[int]:
        return self.steps_per_epoch or self.num_batches

    def first_batch(self) -> Any:
        """The first batch, as the model's step receives it."""
        return _take(self.rows, np.arange(self.bounds[0], self.bounds[1]))

    def epoch(self, epoch: int, seed: int) -> list[np.ndarray]:
        """Row indices of each global batch of ``epoch`` (0-based), the same on every worker."""
        if self.batch_size is not None:
            order = np.arange(self.num_rows)
            if self.shuffle:
                order = np.random.default_rng([seed, epoch]).permutation(self.num_rows)
            batches = [order[i:i + self.batch_size] for i in range(0, self.num_rows, self.batch_size)]
        else:
            batches = [np.arange(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:])]
            if self.shuffle:
                batches = [batches[i] for i in np.random.default_rng([seed, epoch]).permutation(len(batches))]
        if self.steps_per_epoch:  # the epochs go on through the batches, starting over when they run out
            start = epoch * self.steps_per_epoch
            batches = [batches[(start + i) % len(batches)] for i in range(self.steps_per_epoch)]
        return batches

    def dropped_rows(self, world: int) -> Optional[int]:
        """Rows per epoch in global batches too small to give every worker a row."""
        if not self.counted:
            return None
        sizes = np.diff(self.bounds) if self.batch_size is None else \
            np.diff(np.r_[np.arange(0, self.num_rows, self.batch_size), self.num_rows])
        return int(sizes[sizes < world].sum())

    def steps_on(self, world: int, epoch: int, seed: int) -> Optional[int]:
        """Each worker's steps in ``epoch``: global batches too small to give every worker a row are left out."""
        if not self.counted:
            return None
        return sum(1 for batch in self.epoch(epoch, seed) if len(batch) >= world)

    def uneven_batches(self, world: int) -> bool:
        """Whether a global batch of the first epoch does not divide over ``world`` workers."""
        return world > 1 and (not self.counted or any(len(b) % world for b in self.epoch(0, 0)))

    def worker_dataset(self, epochs: range, seed: int, rank: int, world: int, training: bool, skip: int = 0,
                       record: Optional[Callable[[np.ndarray], Any]] = None):
        """This worker's batches of one epoch of ``epochs`` as a ``tf.data.Dataset`` that fit() iterates once per
        epoch, and ``choose(epoch)``, which says which epoch its next pass is (call it when the epoch begins: a
        callback's ``on_epoch_begin``, ahead of the epoch's iterator). Returns (dataset, choose).

        One pass per epoch, as fit() reads the user's arrays: a model compiled with ``steps_per_execution`` runs
        its last execution of an epoch short, where one dataset of every epoch read with ``steps_per_epoch`` would
        run it into the next epoch's batches. ``training``: batches that cannot give every worker a row are left
        out, so every worker has the same steps. ``skip``: the first epoch's batches already trained (a run that goes
        on from a checkpoint inside that epoch, app.training.keras_worker) are left out of it. ``record``: handed
        the ids of each batch's rows as fit() reads it (app.training.keras_audit; a pipeline's elements carry no ids:
        the driver refuses the audit for one)."""
        import tensorflow as tf

        if self.pipeline is not None:
            return self._rerun(epochs, seed, rank, world, training), lambda epoch: None
        parts, counts = [], []
        for e in epochs:
            kept = [batch for batch in self.epoch(e, seed) if len(batch) >= world or not training and len(batch) > rank]
            kept = kept[skip:] if e == epochs.start else kept
            parts += [batch[rank * len(batch) // world:(rank + 1) * len(batch) // world] for batch in kept]
            counts.append(len(kept))
        index = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
        starts = np.r_[0, np.cumsum([len(p) for p in parts])].astype(np.int64)
        leaves = [tf.constant(a) for a in tf.nest.flatten(self.rows)]
        index_t, starts_t = tf.constant(index), tf.constant(starts)
        first_part_t = tf.constant(np.r_[0, np.cumsum(counts)].astype(np.int64))
        with tf.device("/cpu:0"):
            chosen = tf.Variable(0, dtype=tf.int64, trainable=False)  # which epoch of ``epochs`` (from 0)

        ids_t = None if record is None else tf.constant(
            np.arange(self.num_rows, dtype=np.int64) if self.ids is None else np.asarray(self.ids, np.int64))

        def batch(i):
            take = index_t[starts_t[i]:starts_t[i + 1]]
            rows = tf.nest.pack_sequence_as(self.rows, [tf.gather(leaf, take) for leaf in leaves])
            if ids_t is None:
                return rows
            seen = tf.numpy_function(record, [tf.gather(ids_t, take)], tf.int64, stateful=True)
            with tf.control_dependencies([seen]):  # recorded as the batch is delivered
                return tf.nest.map_structure(tf.identity, rows)

        def one_epoch(_):  # read when a pass begins: after choose()
            k = chosen.read_value()
            return tf.data.Dataset.range(first_part_t[k], first_part_t[k + 1])

        ds = tf.data.Dataset.from_tensors(0).flat_map(one_epoch)
        if len(set(counts)) == 1:  # fit() knows an epoch's steps (callbacks' params["steps"]), as for arrays
            ds = ds.apply(tf.data.experimental.assert_cardinality(counts[0]))
        return epoch_pass(ds.map(batch)), lambda epoch: chosen.assign(epochs.index(epoch))

    def _rerun(self, epochs: range, seed: int, rank: int, world: int, training: bool):
        """The user's pipeline with, of each batch, this worker's rows (as above): one pass per epoch, for fit() to
        iterate as it iterates the user's dataset (its number of batches known to fit() if the user's is, so fit()
        draws its passes as it would from the user's). A run that goes on at epoch ``epochs.start`` draws (without
        reading them) the passes an unbroken run's fit() would have drawn before it."""
        import tensorflow as tf

        def one(element):  # tf.data passes a tuple's parts as arguments
            return element[0] if len(element) == 1 else element

        def size(element):
            return tf.shape(tf.nest.flatten(element)[0])[0]

        def kept(*element):
            n = size(one(element))
            return n >= world if training else tf.logical_or(n >= world, n > rank)

        def part(*element):
            element = one(element)
            n = size(element)
            return tf.nest.map_structure(lambda a: a[rank * n // world:(rank + 1) * n // world], element)

        ds = self.pipeline.dataset(seed)
        counted = int(ds.cardinality()) >= 0
        if not self.counted:  # files read by the workers: every worker sees the same batches and keeps the same
            if world > 1:
                ds = ds.filter(kept)
                counted = False
        else:
            sizes = np.diff(self.bounds)
            steps = int((sizes >= world).sum()) if training else int(((sizes >= world) | (sizes > rank)).sum())
            if steps < self.num_batches:
                ds = ds.filter(kept)
        ds = ds.map(part)
        if counted and self.counted:
            ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
        for _ in range(keras_passes_before(epochs.start, counted)):
            iter(ds)  # an iterator made moves the pipeline's shuffles on by one pass, read or not
        return ds.prefetch(2)


def _take(rows: Any, index: np.ndarray) -> Any:
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: a[index], rows)


def is_array_input(x: Any) -> bool:
    """Arrays as fit() takes them: an array, or a dict, list or tuple of them."""
    if isinstance(x, dict):
        return bool(x) and all(is_array_input(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(is_array_input(v) for v in x)
    return isinstance(x, np.ndarray) or (hasattr(x, "__array__") and hasattr(x, "shape"))


def check_class_weight(class_weight: Any) -> None:
    """Keras takes ``class_weight`` as a dict; an array (scikit-learn's ``compute_class_weight``) is refused."""
    if class_weight is not None and not isinstance(class_weight, dict):
        raise UserError(f"class_weight must be a dict {{class id: weight}}, as in Keras (got a "
                        f"{type(class_weight).__name__}); from scikit-learn's compute_class_weight: "
                        "class_weight=dict(enumerate(weights))")


def read(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: Optional[int], shuffle: Any = True,
         steps_per_epoch: Optional[int] = None, class_weight: Any = None, epochs: int = 1,
         what: str = "x", rerun: bool | str = False) -> KerasData:
    """One fit() input, read once through Keras's adapter (see the module docstring); ``rerun``: a tf.data.Dataset
    is also kept as its pipeline, for the workers to run every epoch, when it can be (``"files"``: only one that
    reads files). A pipeline that reads files is read here for its first batch only."""
    arrays = is_array_input(x)
    check_class_weight(class_weight)
    pipeline, read_once = None, ""
    if rerun and is_tf_dataset(x):
        # Kept as its graph: the workers rebuild it with seed generators of their own, at its first pass whatever
        # the read below draws.
        pipeline, read_once = (None, "steps_per_epoch is given") if steps_per_epoch else \
            (None, "class_weight is given") if class_weight is not None else serialise(x)
        if rerun == "files" and pipeline is not None and not pipeline.files:
            pipeline = None  # validation data in memory: read here, as before
    if arrays:
        refuse_unreadable(x, y, sample_weight, what)
    if steps_per_epoch is not None and arrays:
        raise UserError("steps_per_epoch with arrays: every epoch here visits every row once, as fit() does without "
                        "it; leave it out, or give a repeating tf.data.Dataset")
    try:  # a generator's first batches are read here (Keras's adapter peeks at them)
        adapter = internals.keras_data_adapter(x, y, sample_weight, batch_size, steps_per_epoch, class_weight)
    except Exception as e:
        if _raised_at(e):
            raise _users_error(e, x, what) from e
        if isinstance(e, (ValueError, TypeError)):  # Keras's own refusal of the input
            raise UserError(f"{what}: {_first_line(e)}") from None
        raise
    if steps_per_epoch is None and _endless(x, epochs):
        raise UserError(f"{what} is {_endless(x, epochs)}: give steps_per_epoch (batches per epoch), as Keras's fit "
                        "needs it for more than one pass")
    infinite = steps_per_epoch is None and getattr(adapter, "num_batches", 0) is None and not arrays
    limit = steps_per_epoch * epochs if steps_per_epoch else None
    import keras
    import tensorflow as tf

    batches, first, held = [], None, 0
    # A pipeline that reads files: the workers read them (app.data.tf_pipeline); here, its first batch alone.
    lazy = pipeline is not None and bool(pipeline.files)
    for batch in _users_code(adapter.get_numpy_iterator(), x, what):
        # Lists as tuples, as Keras's own array adapter makes them for tf.data: a list of arrays (a model's several
        # inputs) is a structure there, where tf.data would stack it into one tensor.
        batch = keras.tree.lists_to_tuples(tf.nest.map_structure(np.asarray, batch))
        if first is None:
            first = batch
        elif not _same_kind(first, batch):
            raise UserError(f"{what}: its batches change structure or shape from one batch to the next "
                            f"(batch {len(batches) + 1}); every batch must have the same structure, shapes "
                            "and dtypes beyond the batch dimension")
        batches.append(batch)
        held += sum(a.nbytes for a in tf.nest.flatten(batch))
        if lazy or limit is not None and len(batches) >= limit:
            break
        if held > MAX_BYTES:
            raise UserError(f"{what} holds more than {MAX_BYTES >> 30} GiB" + (
                " and has no end: give steps_per_epoch" if infinite else
                ": give a path of files (parquet, CSV, TFRecord) or a ray.data.Dataset to stream it instead"))
    if not batches:
        raise UserError(f"{what} gave no batches: it is empty")
    rows = tf.nest.map_structure(lambda *leaves: np.concatenate(leaves), *batches)
    bounds = np.r_[0, np.cumsum([len(tf.nest.flatten(b)[0]) for b in batches])].astype(np.int64)
    py_dataset = not arrays and is_py_dataset(x)
    return KerasData(rows, bounds, batch_size if arrays else None,
                     shuffle=bool(shuffle) if arrays or py_dataset else False, steps_per_epoch=steps_per_epoch,
                     pipeline=pipeline, read_once=read_once, counted=not lazy)


def _users_code(batches: Iterator[Any], x: Any, what: str) -> Iterator[Any]:
    """``batches``, with an error raised by the user's own data code (a PyDataset's ``__getitem__``, a generator,
    a tf.data pipeline's ``map``) told in one line that names it and where it was raised; the traceback chained."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except UserError:
            raise
        except Exception as e:
            raise _users_error(e, x, what) from e
        yield batch


def _users_error(e: Exception, x: Any, what: str) -> UserError:
    import inspect

    code = (f"{type(x).__name__}.__getitem__" if is_py_dataset(x) else
            f"the generator {getattr(x, '__name__', type(x).__name__)}" if inspect.isgenerator(x) else
            "its tf.data pipeline" if is_tf_dataset(x) else type(x).__name__)
    return UserError(f"{what}: {raised(e, code)}")


def raised(e: Exception, code: str) -> str:
    """"<code> raised <Error>: <its words> (file.py line N)": an error of the user's own code, in one line."""
    return f"{code} raised {type(e).__name__}: {words_of(e)}{_raised_at(e)}"


def _raised_at(error: BaseException) -> str:
    """" (file.py line N)": the last frame of the traceback in the user's own code (app.errors.users_file)."""
    import traceback
    from pathlib import Path

    frames = [f for f in traceback.extract_tb(error.__traceback__) if users_file(f.filename)]
    return f" ({Path(frames[-1].filename).name} line {frames[-1].lineno})" if frames else ""


def _endless(x: Any, epochs: int) -> str:
    """Why this input cannot give the epochs without ``steps_per_epoch`` ("" when it can)."""
    import inspect

    if inspect.isgenerator(x) and epochs > 1:
        return "a generator, which is read once (a second epoch would find it spent)"
    if any(c.__name__ == "DatasetV2" for c in type(x).__mro__):
        import tensorflow as tf

        if x.cardinality() == tf.data.INFINITE_CARDINALITY:
            return "a tf.data.Dataset with no end (repeat())"
    return ""


def is_py_dataset(x: Any) -> bool:
    return any(c.__name__ == "PyDataset" for c in type(x).__mro__)


def _same_kind(a: Any, b: Any) -> bool:
    """Two batches of the same structure, dtypes and shapes beyond the batch dimension."""
    import tensorflow as tf

    try:
        tf.nest.assert_same_structure(a, b)
    except (ValueError, TypeError):
        return False
    return all(x.dtype == y.dtype and x.shape[1:] == y.shape[1:] for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)))


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]
