"""A Ray Train worker's side: what it reads (``WorkerInputs``, decided once in the driver) and its ``RaySession``
(MultiWorkerMirroredStrategy, its shards or the object-store arrays, ray.train checkpoints and reports), given to
the one per-worker function, app.training.worker.train_worker."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

from app.config import TrainConfig
from app.data.arrays import DataFacts
from app.driver import cluster
from app.training import checkpoint
from app.training.collective import Collective
from app.training.worker import train_worker
from app.ui import console


@dataclass(frozen=True)
class WorkerInputs:
    """What every worker reads its data from, decided once in the driver (``of``): its shards of the Ray
    Datasets (streamed files; Ray Train hands each worker its shard by name), or the splits put in the object
    store once (in-memory data; each worker takes its part of every step's global batch of the epoch's seeded
    order)."""

    facts: DataFacts  # as the driver's checks settled them (the task once the model is known)
    streamed: bool
    shuffle_buffer: int = 0  # streamed: rows each worker's shuffle buffer holds
    train: Any = None  # in memory: the ObjectRef of the training Split
    val: Any = None  # in memory: the ObjectRef of the validation Split

    @classmethod
    def of(cls, source, facts: DataFacts) -> "WorkerInputs":
        import ray

        if source.streamed:
            return cls(facts, streamed=True, shuffle_buffer=source.shuffle_buffer)
        return cls(facts, streamed=False, train=ray.put(source.train), val=ray.put(source.val))


class RaySession:
    """A Ray Train worker's side of ``train_worker``: MWMS, its input, ray.train checkpoints and reports."""

    coordinator = None  # synchronous replicas

    def __init__(self, config: TrainConfig, inputs: "WorkerInputs", start_from: Optional[str] = None):
        import ray.train

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.config, self._inputs, self.start_from = config, inputs, start_from
        self.collective = Collective(self.world, config.stall_timeout_s, self.rank)
        if inputs.streamed:
            # The shards first: asking for them starts Ray Data's split coordinators (new
            # processes) while this one imports TensorFlow, instead of after it (~3 s).
            self._shards = ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val")

    def strategy(self):
        from app.training.strategy import ray_worker_strategy

        return ray_worker_strategy(self.config.cpus_per_worker, self.config.stall_timeout_s, self.world,
                                   self.config.tensor_degree)

    def restore(self, model, optimizer) -> Optional[dict[str, Any]]:
        import ray.train

        restored = ray.train.get_checkpoint()
        if restored is None:
            # A run resumed from a checkpoint another backend wrote (<output>/checkpoint of a local run): it
            # is read from the driver's disk, until this Ray run has a checkpoint of its own.
            return checkpoint.restore_from(self.start_from, model, optimizer) if self.start_from else None
        with restored.as_directory() as d:
            return checkpoint.restore(d, model, optimizer)

    def inputs(self, strategy, plan, start_epoch: int, start_step: int = 0):
        import ray

        from app.data import tf_input

        config, facts = self.config, self._inputs.facts
        if self._inputs.streamed:
            train_shard, val_shard = self._shards

            def train(_):
                return tf_input.train_batches_from_shard(
                    train_shard, plan, facts, config.epochs - start_epoch,
                    shuffle_buffer=self._inputs.shuffle_buffer, seed=config.seed,
                )

            def val(_):
                return tf_input.eval_batches_from_shard(val_shard, config.per_replica_batch, facts)
        else:
            # Put in the object store once by the driver; each worker takes its slice of a
            # seeded permutation every epoch: no Ray task per epoch, exactly once by construction.
            train_split, val_split = ray.get([self._inputs.train, self._inputs.val])

            def train(_):
                return tf_input.train_batches_from_arrays(
                    train_split, plan, config.seed, config.shuffle, start_epoch, config.epochs, self.rank, start_step
                )

            def val(_):
                return tf_input.eval_batches_from_arrays(val_split, config.per_replica_batch, 1, self.rank, self.world)
        inputs = iter(strategy.distribute_datasets_from_function(train)), strategy.distribute_datasets_from_function(val)
        # Never destroyed before the process ends: a tf.data iterator's destructor waits for
        # tf.data's autotuning thread to wake (7-60 s after the last report; the gdb stack is in docs/design.md).
        # The worker process is ended by Ray Train right after the function returns.
        _KEPT_UNTIL_EXIT.extend(inputs)
        return inputs

    def placement(self, strategy) -> list[str]:
        import ray

        return cluster.worker_nodes(self.collective, ray.get_runtime_context().get_node_id())

    def save_and_report(self, metrics, state, write: Callable[[str], None]) -> None:
        import ray.train
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            # Only rank 0 writes: replicas hold identical weights after every step.
            if self.rank == 0:
                write(tmp)
                ckpt = Checkpoint.from_directory(tmp)
            # Every worker reports (it is a barrier); Train V2 keeps only reports with a checkpoint.
            ray.train.report(metrics, checkpoint=ckpt)

    def progress_bar(self, total: int, desc: str):
        return progress_bar(total, desc)

    def alive(self) -> None:
        """Nothing to tell: a frozen peer fails the collectives (--stall-timeout-s, app.training.strategy)."""


def progress_bar(total: int, desc: str) -> "_Flushed":
    """A bar for a Ray actor's epoch, drawn by the driver (app.ui.console): ray.experimental.tqdm_ray."""
    from ray.experimental import tqdm_ray

    return _Flushed(tqdm_ray.tqdm(total=total, desc=desc, unit="step"))


class _Flushed:
    """A tqdm_ray bar whose updates leave this process at once: they are lines on stdout, which is a file here."""

    def __init__(self, bar):
        self.bar = bar

    def update(self, k: int) -> None:
        self.bar.update(k)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
        sys.stdout.flush()


_KEPT_UNTIL_EXIT: list[Any] = []


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    """Runs in every Ray Train worker: the one per-worker function, with a Ray session."""
    # Our lines are marked for the driver's console; the rest of this process's output
    # (Ray Train's reports, TensorFlow's notices) goes to the run's log file (app.ui.console).
    console.mark_worker_console("app")
    session = RaySession(payload["config"], payload["inputs"], payload.get("start_from"))
    train_worker(payload["config"], payload["job"], session)
