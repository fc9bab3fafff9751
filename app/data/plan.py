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
    order is reshuffled). The runs this plan trains are the product's own step
    (parameter servers), whose compiled step takes one static
    batch; every other run trains by Keras's fit, which ends each epoch on its
    short last batch itself.
    """

    num_rows: int
    num_workers: int
    per_replica_batch: int
    replicas_per_worker: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step
    # Parameter servers: every worker applies its own batches, each one optimizer update, without waiting.
    asynchronous: bool = False

    @classmethod
    def for_run(cls, config, num_rows: int, num_workers: int, replicas_per_worker: int = 1,
                asynchronous: bool = False) -> "EpochPlan":
        # --global-batch: each replica's equal part of it at this size (app.config.TrainConfig.at_size).
        per_replica = config.at_size(num_workers * replicas_per_worker).per_replica_batch
        return cls(num_rows, num_workers, per_replica, replicas_per_worker, config.grad_accum, asynchronous)

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
    def steps(self) -> int:
        return (self.num_rows // self.num_workers) // (self.step_batch * self.replicas_per_worker)

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch

    def slices(self) -> tuple[np.ndarray, np.ndarray]:
        """Each worker's batches of one epoch, in order (``replicas_per_worker`` per step): where each starts in the
        epoch's order of rows, and how many rows it has; row r of each array is worker r's. Step s's global batch
        is rows [s * G, (s + 1) * G) whatever the number of workers; replica k of the run (rank x replicas + local
        index) takes its k-th part."""
        replicas = self.num_workers * self.replicas_per_worker
        steps = np.arange(self.steps)[:, None, None] * self.global_batch
        local = np.arange(replicas).reshape(self.num_workers, 1, self.replicas_per_worker) * self.step_batch
        starts = (steps + local.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(self.num_workers, -1)
        sizes = np.full(starts.shape, self.step_batch)
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
