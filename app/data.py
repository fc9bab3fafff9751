"""Data: sources -> arrays -> Ray Datasets; a worker's shard -> tf.data.

Every row carries an integer ``id`` (its index in the source) so that the
"every sample exactly once per epoch" rule can be audited, and validation rows
carry a weight ``w`` so that padding rows (added to give every worker the same
number of evaluation batches) count for nothing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from app.errors import UserError

if TYPE_CHECKING:  # heavy imports stay out of config validation and --help
    import ray.data
    import tensorflow as tf

    from app.config import TrainConfig

log = logging.getLogger(__name__)

X, Y, ID, W = "x", "y", "id", "w"


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # float32, (n, *feature_shape)
    y: np.ndarray  # int64, (n,)
    ids: np.ndarray  # int64, (n,)

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class Source:
    train: Split
    val: Split
    num_classes: int

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    @property
    def num_train_rows(self) -> int:
        return len(self.train)


def _digits(config: "TrainConfig") -> tuple[np.ndarray, np.ndarray]:
    # scikit-learn ships these 1,797 8x8 images inside the wheel: no download.
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def _synthetic(config: "TrainConfig") -> tuple[np.ndarray, np.ndarray]:
    """Seeded, learnable data of any shape: a per-class pattern under unit Gaussian noise.

    For benchmarks and tests: the size and shape are whatever the config says,
    and a model can still learn it (the pattern's amplitude is small enough
    that it takes a few epochs, not one step).
    """
    rng = np.random.default_rng(config.seed + 1)
    shape = tuple(config.synthetic_shape)
    patterns = rng.normal(size=(config.synthetic_classes, *shape)).astype(np.float32)
    y = rng.integers(0, config.synthetic_classes, size=config.synthetic_rows, dtype=np.int64)
    x = rng.normal(size=(config.synthetic_rows, *shape)).astype(np.float32)
    x += 0.5 * patterns[y]
    return x, y


def _synthetic_text(config: "TrainConfig") -> tuple[np.ndarray, np.ndarray]:
    """Generated labelled texts (app.text), tokenized: the built-in text dataset for the transformer."""
    from app import text

    texts, y = text.synthetic_corpus(config.synthetic_text_rows, config.synthetic_classes, config.seed)
    return text.tokenize(texts, config.vocab_size, config.sequence_length), y


DATASETS: dict[str, Callable[["TrainConfig"], tuple[np.ndarray, np.ndarray]]] = {
    "digits": _digits,
    "synthetic": _synthetic,
    "synthetic-text": _synthetic_text,
}


def split_holdout(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[Split, Split]:
    """A seeded train/val split; ids are row indices in the source."""
    ids = np.arange(len(y), dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    if n_val == 0 or n_val == len(y):
        raise UserError(f"val_fraction={val_fraction} leaves an empty train or val set for {len(y)} rows")
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    return (
        Split(x[train_idx], y[train_idx], ids[train_idx]),
        Split(x[val_idx], y[val_idx], ids[val_idx]),
    )


def load_source(config: "TrainConfig") -> Source:
    """A built-in dataset, or a .npz / .npy one (app.sources), in memory; file formats that stream are refused."""
    if config.dataset in DATASETS:
        x, y = DATASETS[config.dataset](config)
    else:
        from app import sources

        x, y = sources.load_numpy(config, config.dataset)
    if config.val_dataset:
        from app import sources

        vx, vy = sources.load_numpy(config, config.val_dataset)
        if vx.shape[1:] != x.shape[1:]:
            raise UserError(f"--val-dataset examples have shape {vx.shape[1:]}, the training data {x.shape[1:]}")
        # Validation ids continue after the training ids: still one id per row.
        train = Split(x, y, np.arange(len(y), dtype=np.int64))
        val = Split(vx, vy, np.arange(len(y), len(y) + len(vy), dtype=np.int64))
        high = max(int(y.max()), int(vy.max()))
    else:
        train, val = split_holdout(x, y, config.val_fraction, config.seed)
        high = int(y.max())
    return Source(train=train, val=val, num_classes=config.num_classes or high + 1)


# --- epoch arithmetic --------------------------------------------------------


@dataclass(frozen=True)
class EpochPlan:
    """How one epoch divides over the replicas.

    Ray's ``streaming_split(equal=True)`` gives every worker floor(n / workers)
    rows; each worker then takes ``steps`` global steps, each one full batch per
    local replica. MultiWorkerMirroredStrategy needs the same step count on
    every worker or its all-reduce waits forever, so the remainder is dropped,
    and a different remainder every epoch because the order is reshuffled.
    """

    num_rows: int
    num_workers: int
    per_replica_batch: int
    replicas_per_worker: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step

    @property
    def step_batch(self) -> int:
        """Rows one replica takes per optimizer step (all its micro-batches)."""
        return self.per_replica_batch * self.grad_accum

    @property
    def global_batch(self) -> int:
        """The effective global batch: rows behind one optimizer step, over every replica."""
        return self.num_workers * self.replicas_per_worker * self.step_batch

    @property
    def steps(self) -> int:
        return (self.num_rows // self.num_workers) // (self.step_batch * self.replicas_per_worker)

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch

    @property
    def dropped(self) -> int:
        return self.num_rows - self.samples

    def as_dict(self) -> dict[str, int]:
        return {
            "rows": self.num_rows,
            "workers": self.num_workers,
            "replicas_per_worker": self.replicas_per_worker,
            "per_replica_batch": self.per_replica_batch,
            "grad_accum": self.grad_accum,
            "global_batch": self.global_batch,
            "steps": self.steps,
            "samples": self.samples,
            "dropped": self.dropped,
        }

    def check(self) -> None:
        if self.steps == 0:
            raise UserError(
                f"global batch {self.global_batch} (= {self.per_replica_batch} per replica x "
                f"{self.num_workers * self.replicas_per_worker} replicas x {self.grad_accum} accumulated) is larger "
                f"than the {self.num_rows} "
                "training rows: lower --per-replica-batch or the number of workers/devices"
            )


# --- Ray Data ----------------------------------------------------------------


def padded_with_zero_weight(split: Split, multiple: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, ids, weights) with weight-0 copies of the first row appended until the count divides by ``multiple``.

    Padding rows have id -1 and weigh nothing in the loss and metric sums; they
    exist so that every worker or replica gets the same number of eval batches.
    """
    x, y, ids = split.x, split.y, split.ids
    w = np.ones(len(y), dtype=np.float32)
    pad = (-len(y)) % multiple
    if pad:
        x = np.concatenate([x, np.repeat(x[:1], pad, axis=0)])
        y = np.concatenate([y, np.repeat(y[:1], pad)])
        ids = np.concatenate([ids, np.full(pad, -1, dtype=np.int64)])
        w = np.concatenate([w, np.zeros(pad, dtype=np.float32)])
    return x, y, ids, w


def to_ray_dataset(split: Split, *, pad_to_multiple_of: int = 1, weights: bool = False) -> "ray.data.Dataset":
    """Arrays -> a Ray Dataset with columns x, y, id (and w).

    With ``pad_to_multiple_of=k`` rows of weight 0 are appended so that the row
    count divides by k: validation then splits into equal shards, every worker
    runs the same number of eval batches, and no real row is dropped.
    """
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    x, y, ids, w = padded_with_zero_weight(split, pad_to_multiple_of)
    columns = {X: ArrowTensorArray.from_numpy(x), Y: pa.array(y), ID: pa.array(ids)}
    if weights:
        columns[W] = pa.array(w)
    return ray.data.from_arrow(pa.table(columns))


def shuffled_each_epoch(ds: "ray.data.Dataset", seed: int) -> "ray.data.Dataset":
    """A global shuffle that Ray Data re-runs, with a new derived seed, every epoch.

    ``reseed_after_execution=True`` combines the seed with Ray Data's execution
    index, so epoch k's order is reproducible from ``seed`` and differs from
    epoch k-1's.
    """
    from ray.data import RandomSeedConfig

    return ds.random_shuffle(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))


# --- worker side: a shard -> tf.data ------------------------------------------


def _batch_signature(feature_shape: tuple[int, ...], third: "tf.DType") -> tuple:
    import tensorflow as tf

    return (
        tf.TensorSpec((None, *feature_shape), tf.float32),
        tf.TensorSpec((None,), tf.int64),
        tf.TensorSpec((None,), third),
    )


def train_batches_from_shard(
    shard, plan: EpochPlan, feature_shape: tuple[int, ...], epochs: int, shuffle_buffer: int = 0, seed: int = 0
) -> "tf.data.Dataset":
    """Per-replica (x, y, id) batches for ``epochs`` epochs of ``plan.steps`` each.

    Each call of the generator is one pass of the Ray shard (one epoch, newly
    shuffled); ``repeat()`` starts the next pass, so the prefetch overlaps the
    epoch boundary. The cardinality stays "infinite" to TensorFlow, which spares
    a per-step all-reduce in multi-worker mode; after the last planned epoch
    the generator comes back empty, which ends ``repeat()``. A shard with fewer
    full batches than planned raises instead of letting the other workers wait
    in the all-reduce forever.

    With ``shuffle_buffer`` (streamed data, which is not shuffled globally)
    rows are shuffled in a local buffer of that many rows, seeded anew each
    pass; the shard still holds the same rows, so the step count is unchanged.
    """
    import tensorflow as tf

    passes_left = [epochs]

    def epoch() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if passes_left[0] <= 0:
            return
        passes_left[0] -= 1
        taken = extra = 0
        shuffle = (
            {"local_shuffle_buffer_size": shuffle_buffer, "local_shuffle_seed": seed * 1_000_003 + passes_left[0]}
            if shuffle_buffer
            else {}
        )
        for batch in shard.iter_batches(
            batch_size=plan.step_batch, batch_format="numpy", drop_last=True, prefetch_batches=2, **shuffle
        ):
            if taken < plan.steps:
                taken += 1
                yield batch[X], batch[Y], batch[ID]
            else:
                extra += 1
        if taken < plan.steps:
            raise RuntimeError(
                f"uneven shard: this worker got {taken} full batches of {plan.step_batch}, "
                f"the plan needs {plan.steps} on every worker"
            )
        if extra:
            log.warning("shard had %d batches beyond the planned %d; they were skipped", extra, plan.steps)

    ds = tf.data.Dataset.from_generator(epoch, output_signature=_batch_signature(feature_shape, tf.int64))
    return ds.repeat().prefetch(2)


def eval_batches_from_shard(shard, batch_size: int, feature_shape: tuple[int, ...]) -> "tf.data.Dataset":
    """Per-replica (x, y, weight) batches of a padded validation shard, last batch partial."""
    import tensorflow as tf

    def epoch():
        for batch in shard.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=False):
            yield batch[X], batch[Y], batch[W]

    return tf.data.Dataset.from_generator(epoch, output_signature=_batch_signature(feature_shape, tf.float32))


def train_batches_from_arrays(
    split: Split, plan: EpochPlan, seed: int, shuffle: bool, start_epoch: int, epochs: int
) -> "tf.data.Dataset":
    """The local path's input: per-replica (x, y, id) batches, ``plan.steps`` global steps per epoch.

    Same rules as the Ray path: a seeded reshuffle every epoch, whole batches
    only, every sample at most once per epoch. Epoch e's order is shuffled with
    seed (seed, e), so a resumed run sees exactly the order an uninterrupted
    one would have. A strategy with R local replicas takes R consecutive
    batches per step, hence ``take(steps * R)``.
    """
    import tensorflow as tf

    x, y, ids = (tf.constant(a) for a in (split.x, split.y, split.ids))

    def one_epoch(epoch):
        order = tf.range(len(split), dtype=tf.int64)
        if shuffle:  # stateless: the permutation is a pure function of (seed, epoch)
            order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
        batches = tf.data.Dataset.from_tensor_slices(order).batch(plan.step_batch, drop_remainder=True)
        return batches.take(plan.steps * plan.replicas_per_worker)

    def gather(index):
        return tf.gather(x, index), tf.gather(y, index), tf.gather(ids, index)

    return (
        tf.data.Dataset.range(start_epoch, epochs)
        .flat_map(one_epoch)
        .map(gather, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def eval_batches_from_arrays(split: Split, batch_size: int, replicas: int = 1) -> "tf.data.Dataset":
    """The same (x, y, weight) batches from arrays in memory, for a plain process.

    With several local replicas, weight-0 rows pad the set to whole rounds of
    ``replicas`` batches: otherwise the last round hands some replicas an empty
    batch, which some kernels (Conv2D + batch norm on CPU) reject.
    """
    import tensorflow as tf

    x, y, _, w = padded_with_zero_weight(split, batch_size * replicas if replicas > 1 else 1)
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(batch_size)
