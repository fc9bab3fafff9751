"""A worker's data -> per-replica tf.data batches, with the same rules on every path.

Rules: a seeded reshuffle every epoch, whole batches only (but for the short
last batch of a plan that has one: app.data.plan), the same number of
steps on every worker (MWMS's all-reduce waits forever for a missing peer),
every sample at most once per epoch, validation padded with weight-0 rows so
that every worker runs the same number of eval batches and no row is lost.

Two kinds of input:

- arrays in memory (built-in data, numpy files, data functions), on the local
  path and on Ray workers alike (there, the arrays come from the object store,
  put once by the driver): each epoch is a seeded permutation of all rows, a
  pure function of (seed, epoch), and worker ``rank`` of ``world`` takes its
  contiguous slice of it: exactly once by construction, as a distributed
  sampler does, with no Ray task per epoch;
- a Ray Data shard of validation rows (jobs/evaluate.py on files): Ray Data deals the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.data.arrays import DataFacts, Split, W, Y, nest_map, padded_with_zero_weight, x_of
from app.data.plan import EpochPlan

if TYPE_CHECKING:
    import tensorflow as tf


def _batch_signature(facts: DataFacts) -> tuple:
    """A streamed validation batch: (x, y, weights); streamed data has one label, and one input or named inputs
    (--inputs)."""
    import tensorflow as tf

    x = lambda shape: tf.TensorSpec((None, *shape), tf.float32)  # noqa: E731
    return (
        {k: x(shape) for k, shape in facts.input_shapes.items()} if facts.input_shapes else x(facts.feature_shape),
        tf.TensorSpec((None, *facts.label_shape), tf.as_dtype(facts.label_dtype)),
        tf.TensorSpec((None,), tf.float32),
    )


def train_batches_from_arrays(
    split: Split, plan: EpochPlan, seed: int, shuffle: bool, start_epoch: int, epochs: int, rank: "int | tf.Tensor" = 0,
    start_step: int = 0,
) -> "tf.data.Dataset":
    """Per-replica (x, y, id, sample weight) batches, ``plan.steps`` global steps per epoch, from ``start_epoch`` on.

    Epoch e's order is shuffled with seed (seed, e), so a resumed or restarted
    run sees exactly the order an uninterrupted one would have. Step s's global
    batch is rows [s * G, (s + 1) * G) of that order, whatever the number of
    workers (G: the global batch), and each replica takes its part of it
    (``plan.slices``: worker ``rank``'s parts, its local replicas' one after
    the other; ``rank`` may be a tensor, as a parameter-server worker's). So N
    workers train on the very batches one worker with the global batch does,
    as Keras's ``fit`` with ``shuffle=False`` takes them
    (rows 0..G-1 first).
    ``start_step``: the first epoch starts there (a checkpoint inside it), at the
    very rows an uninterrupted run would have gone on with, whatever the size.
    """
    import tensorflow as tf

    x, y = (tf.nest.map_structure(tf.constant, a) for a in (split.x, split.y))
    ids, w = tf.constant(split.ids), tf.constant(split.weights())
    starts, sizes = (tf.gather(tf.constant(a), rank) for a in plan.slices())

    def one_epoch(epoch):
        order = tf.range(len(split), dtype=tf.int64)
        if shuffle:  # stateless: the permutation is a pure function of (seed, epoch)
            order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
        return tf.data.Dataset.from_tensor_slices((starts, sizes)).map(
            lambda start, n: tf.ensure_shape(order[start:start + n], (plan.step_batch,)))

    def gather(index):
        rows = lambda t: tf.gather(t, index)  # noqa: E731
        return tf.nest.map_structure(rows, x), tf.nest.map_structure(rows, y), rows(ids), rows(w)

    return (
        tf.data.Dataset.range(start_epoch, epochs)
        .flat_map(one_epoch)
        .skip(start_step * plan.replicas_per_worker)  # index slices only: nothing is gathered for them
        .map(gather, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def eval_batches_from_arrays(
    split: Split, batch_size: int, replicas: int = 1, rank: int = 0, world: int = 1
) -> "tf.data.Dataset":
    """(x, y, weight) batches of this worker's slice of the validation set.

    Weight-0 rows pad the set to a multiple of the worker count (equal slices,
    so equal eval batches everywhere), and with several local replicas to
    whole rounds of ``replicas`` batches: otherwise the last round hands some
    replicas an empty batch, which some kernels (Conv2D + batch norm on CPU)
    reject.
    """
    import tensorflow as tf

    round_rows = batch_size * replicas if replicas > 1 else 1
    x, y, _, w = padded_with_zero_weight(split, world * round_rows)
    share = len(w) // world
    mine = lambda a: a[rank * share:(rank + 1) * share]  # noqa: E731
    return tf.data.Dataset.from_tensor_slices((nest_map(mine, x), nest_map(mine, y), mine(w))).batch(batch_size)


def eval_batches_from_shard(shard, batch_size: int, facts: DataFacts) -> "tf.data.Dataset":
    """Per-replica (x, y, weight) batches of a padded validation shard, last batch partial."""
    import tensorflow as tf

    def epoch():
        for batch in shard.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=False):
            yield x_of(batch, facts.input_shapes), batch[Y], batch[W]

    return tf.data.Dataset.from_generator(epoch, output_signature=_batch_signature(facts))
