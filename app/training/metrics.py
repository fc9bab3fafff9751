"""The own loop's epoch metrics: exact sums over every replica, and the per-epoch record.

Loss, sample count and every metric's state are summed per replica and added
once per epoch (app.training.measures), so a val accuracy is the accuracy over
the whole validation set, not an average of per-replica averages, and an AUC is
the AUC of all the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from app.training.objective import metric_in, metric_names_in


@dataclass
class EpochStats:
    loss: float
    metrics: dict[str, float]  # each metric's value over every row (accuracy, mae, auc, ...)
    samples: int
    seconds: float
    first_step_time: Optional[float] = None  # wall clock when the first step finished
    sample_ids: Optional[np.ndarray] = field(default=None, repr=False)  # all replicas' ids, if audited

    @classmethod
    def from_sums(cls, sums: np.ndarray, seconds: float, results: Callable[[np.ndarray], dict[str, float]],
                  **extra) -> "EpochStats":
        """[loss sum, count, metric states] -> the stats; ``results``: the measures' states -> values."""
        loss_sum, count = sums[0], sums[1]
        return cls(loss_sum / max(count, 1), results(sums[2:]), int(count), seconds, **extra)


def local_sum(strategy, per_replica):
    """This worker's replicas' values, added."""
    import tensorflow as tf

    return tf.add_n(list(strategy.experimental_local_results(per_replica)))


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB, on every platform.

    The Unix kernels keep it in getrusage's ru_maxrss (KiB on Linux, bytes on macOS); Windows has no
    `resource` module, and psutil reads its peak working set there. psutil has no peak on Linux or macOS
    (only the current RSS), hence the two sources."""
    import sys

    if sys.platform == "win32":
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def epoch_metrics(epoch: int, train: EpochStats, val: EpochStats, learning_rate: float, dropped: int) -> dict:
    """The per-epoch record shared by every backend (history.csv, Ray reports, TensorBoard)."""
    metrics = {
        "epoch": epoch,
        "train_loss": float(train.loss),
        **{f"train_{name}": float(v) for name, v in train.metrics.items()},
        "val_loss": float(val.loss),
        **{f"val_{name}": float(v) for name, v in val.metrics.items()},
        "learning_rate": float(learning_rate),
        "samples_per_second": train.samples / train.seconds,
        "train_seconds": train.seconds,
        "epoch_seconds": train.seconds + val.seconds,
        "train_samples": train.samples,
        "dropped_samples": dropped,
        "val_samples": val.samples,
    }
    if train.first_step_time is not None:
        metrics["first_step_time"] = train.first_step_time
    if train.sample_ids is not None:
        metrics["audit_ids_seen"] = int(train.sample_ids.size)
        metrics["audit_ids_unique"] = int(np.unique(train.sample_ids).size)
    return metrics


SHORT = {"accuracy": "acc"}  # the console's short names


def progress_line(m: dict, epochs: int, history: list[dict]) -> str:
    """One epoch on the console: losses, every val metric (the run's own first), LR, speed, time left."""
    mean_epoch = sum(h["epoch_seconds"] for h in history) / len(history)
    eta = mean_epoch * (epochs - m["epoch"])
    primary = metric_in(m)
    names = [n for n in metric_names_in(m) if n != "loss"]
    names = ([primary] if primary in names else []) + [n for n in names if n != primary]
    shown = "  ".join(f"val_{SHORT.get(n, n)} {m[f'val_{n}']:.4f}" for n in names)
    return (
        f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  val_loss {m['val_loss']:.4f}  "
        f"{shown}{'  ' if shown else ''}lr {m['learning_rate']:.4g}  "
        f"{m['samples_per_second']:,.0f} samples/s  {m['epoch_seconds']:.1f} s  ETA {eta:.0f} s"
    )
