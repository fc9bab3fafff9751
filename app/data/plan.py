"""How one epoch divides over the replicas: the arithmetic every backend shares."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.errors import UserError


@dataclass(frozen=True)
class EpochPlan:
    """How one epoch divides over the replicas.

    Each global step is one full batch per replica. MultiWorkerMirroredStrategy
    needs the same step count on every worker or its all-reduce waits forever,
    so the rows left over are dropped (a different remainder every epoch: the
    order is reshuffled), unless ``short_last``: then, as Keras's ``fit``, every
    epoch ends with one short step of those rows, cut as evenly as can be over
    every replica (the step divides its loss by the rows it really has:
    app.training.step). Fewer rows left than replicas are still dropped: a
    replica with no rows at all is what some kernels refuse.
    """

    num_rows: int
    num_workers: int
    per_replica_batch: int
    replicas_per_worker: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step
    # Parameter servers: every worker applies its own batches, each one optimizer update, without waiting.
    asynchronous: bool = False
    short_last: bool = False  # the rows left over are one short last step (app.training.objective decides)

    @classmethod
    def for_run(cls, config, num_rows: int, num_workers: int, replicas_per_worker: int = 1,
                asynchronous: bool = False, short_last: bool = False) -> "EpochPlan":
        # --global-batch: each replica's equal part of it at this size (app.config.TrainConfig.at_size).
        per_replica = config.at_size(num_workers * replicas_per_worker).per_replica_batch
        return cls(num_rows, num_workers, per_replica, replicas_per_worker, config.grad_accum, asynchronous, short_last)

    @property
    def step_batch(self) -> int:
        """Rows one replica takes per optimizer step (all its micro-batches)."""
        return self.per_replica_batch * self.grad_accum

    @property
    def global_batch(self) -> int:
        """The effective global batch: rows behind one optimizer step, over every replica."""
        return self.num_workers * self.replicas_per_worker * self.step_batch

    @property
    def update_batch(self) -> int:
        """Rows behind one optimizer update (what the LR rule scales with)."""
        return self.step_batch if self.asynchronous else self.global_batch

    @property
    def updates(self) -> int:
        """Optimizer updates per epoch: one per global step, or one per worker's step when asynchronous."""
        return self.steps * self.num_workers if self.asynchronous else self.steps

    @property
    def full_steps(self) -> int:
        return (self.num_rows // self.num_workers) // (self.step_batch * self.replicas_per_worker)

    @property
    def last_rows(self) -> int:
        """Rows of the short last step (0: none): what whole batches leave, if every replica gets one of them."""
        left = self.num_rows - self.full_steps * self.global_batch
        return left if self.short_last and left >= self.num_workers * self.replicas_per_worker else 0

    @property
    def steps(self) -> int:
        return self.full_steps + (1 if self.last_rows else 0)

    @property
    def samples(self) -> int:
        return self.full_steps * self.global_batch + self.last_rows

    def slices(self) -> tuple[np.ndarray, np.ndarray]:
        """Each worker's batches of one epoch, in order (``replicas_per_worker`` per step): where each starts in the
        epoch's order of rows, and how many rows it has; row r of each array is worker r's. Step s's global batch
        is rows [s * G, (s + 1) * G) whatever the number of workers; replica k of the run (rank x replicas + local
        index) takes its k-th part."""
        replicas = self.num_workers * self.replicas_per_worker
        steps = np.arange(self.full_steps)[:, None, None] * self.global_batch
        local = np.arange(replicas).reshape(self.num_workers, 1, self.replicas_per_worker) * self.step_batch
        starts = (steps + local.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(self.num_workers, -1)
        sizes = np.full(starts.shape, self.step_batch)
        if self.last_rows:
            bounds = self.full_steps * self.global_batch + np.arange(replicas + 1) * self.last_rows // replicas
            starts = np.concatenate([starts, bounds[:-1].reshape(self.num_workers, -1)], axis=1)
            sizes = np.concatenate([sizes, np.diff(bounds).reshape(self.num_workers, -1)], axis=1)
        return starts.astype(np.int64), sizes.astype(np.int64)

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
            "last_rows": self.last_rows,
        }

    def check(self) -> "EpochPlan":
        if self.steps == 0:
            raise UserError(
                f"global batch {self.global_batch} (= {self.per_replica_batch} per replica x "
                f"{self.num_workers * self.replicas_per_worker} replicas x {self.grad_accum} accumulated) is larger "
                f"than the {self.num_rows} "
                "training rows: lower --per-replica-batch or the number of workers/devices"
            )
        return self
