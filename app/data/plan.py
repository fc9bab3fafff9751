"""How one epoch divides over the replicas: the arithmetic every backend shares."""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import UserError


@dataclass(frozen=True)
class EpochPlan:
    """How one epoch divides over the replicas.

    Every worker gets floor(n / workers) rows; each worker then takes
    ``steps`` global steps, each one full batch per local replica.
    MultiWorkerMirroredStrategy needs the same step count on every worker or
    its all-reduce waits forever, so the remainder is dropped, and a different
    remainder every epoch because the order is reshuffled.
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
        return cls(num_rows, num_workers, config.per_replica_batch, replicas_per_worker, config.grad_accum,
                   asynchronous)

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
