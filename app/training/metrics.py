"""The own loop's epoch metrics: exact sums over every replica, and the per-epoch record; the console's epoch
line of every run.

Loss, sample count and every metric's state are summed per replica and added
once per epoch (app.training.measures), so a val accuracy is the accuracy over
the whole validation set, not an average of per-replica averages, and an AUC is
the AUC of all the rows. The record names them ``train_<name>`` / ``val_<name>``
(result.json, TensorBoard, Ray's reports, as a run of Keras's fit names them
there); history.csv and the console name them as Keras's History does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from app.training.objective import metric_names_in


@dataclass
class EpochStats:
    loss: float
    metrics: dict[str, float]  # each metric's value over every row (accuracy, mae, auc, ...)
    samples: int
    seconds: float
    first_step_time: Optional[float] = None  # wall clock when the first step finished

    @classmethod
    def from_sums(cls, sums: np.ndarray, seconds: float, results: Callable[[np.ndarray], dict[str, float]],
                  **extra) -> "EpochStats":
        """[loss sum, count, metric states] -> the stats; ``results``: the measures' states -> values."""
        loss_sum, count = sums[0], sums[1]
        return cls(loss_sum / max(count, 1), results(sums[2:]), int(count), seconds, **extra)


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
    return metrics


def keras_logs(record: dict) -> dict:
    """An own-loop epoch record's losses and metrics under Keras's History names (``train_loss`` -> ``loss``,
    ``train_<metric>`` -> ``<metric>``, ``val_<name>`` as it is): what history.csv and the console name them as, as
    for a run of Keras's fit. result.json, TensorBoard and Ray's reports keep the record's names, every run's."""
    names = metric_names_in(record)
    return {**{n: record[f"train_{n}"] for n in names if f"train_{n}" in record},
            **{f"val_{n}": record[f"val_{n}"] for n in names}}


def history_row(record: dict) -> dict:
    """history.csv's row of an own-loop epoch: the epoch, its logs as Keras names them, then the rest of the record."""
    logs = keras_logs(record)
    renamed = {f"train_{n}" for n in metric_names_in(record)}  # what became a log (val_<name> keeps its name)
    return {"epoch": record["epoch"], **logs, **{k: v for k, v in record.items() if k not in renamed and k not in logs}}


def epoch_line(epoch: int, epochs: int, logs: dict, seconds: float) -> str:
    """One console line per epoch, for every run: its logs as Keras names them, and the epoch's seconds."""
    values = "  ".join(f"{k} {v:.4g}" for k, v in logs.items())
    return f"epoch {epoch}/{epochs}  {values}  ({seconds:.1f} s)"
