"""TensorBoard logs of a run, written by rank 0 only.

Two kinds of scalars, each under its own prefix so TensorBoard draws them on
their own step axis:

- ``step/…`` every ``--log-every-steps`` optimizer steps: the train loss and
  accuracy of the steps since the last point, summed over every worker (one
  small all-reduce per point, not per step), the learning rate and samples/s.
- ``epoch/…`` once per epoch: the epoch record (train and val loss and
  accuracy, learning rate, samples/s), the same numbers as history.csv.

Where the files go: ``<output>/tensorboard`` by default. On a multi-node
cluster rank 0 may run on another machine than the driver, so with
``--storage-path`` (which must be shared for multi-node runs) the logs go to
``<storage-path>/<run name>/tensorboard`` next to the checkpoints. A URI
(``s3://``, ``gs://``…) is written locally first and copied with pyarrow's
filesystems after every epoch: TensorFlow itself no longer ships an S3
filesystem.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Optional

from app.backend import backend_of


def epoch_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """An epoch record's curves: the losses, every metric (train and val), the LR, the speed, and where a step's
    time went (``time_<part>_ms``: app.training.step_clock)."""
    from app.training.objective import metric_names_in

    keys = [f"{part}_{name}" for name in metric_names_in(metrics) for part in ("train", "val")]
    keys += [k for k in metrics if k.startswith("time_") and k.endswith("_ms")]
    return {k: metrics[k] for k in [*keys, "learning_rate", "samples_per_second", "workers"] if k in metrics}


def logdir_for(config, run_name: str) -> Optional[str]:
    """Where this run's TensorBoard files go (None: TensorBoard off)."""
    if not config.tensorboard:
        return None
    if config.tensorboard_dir:
        return config.tensorboard_dir
    # --storage-path is Ray Train's (shared storage every node reaches): local and parameter-server runs
    # keep everything in their output directory (app.driver.outputs warns that it is not used).
    if config.storage_path and backend_of(config).ray_train:
        return f"{config.storage_path.rstrip('/')}/{run_name}/tensorboard"
    return str(config.output_dir() / "tensorboard")


class TensorBoard:
    """Scalar writer; ``TensorBoard(None)`` is a no-op (ranks other than 0, or logging off)."""

    def __init__(self, logdir: Optional[str]):
        self.logdir = logdir
        self._writer = None
        self._staging = None
        if logdir is None:
            return
        import tensorflow as tf

        target = logdir
        if "://" in logdir:
            self._staging = tempfile.mkdtemp(prefix="tensorboard-")
            target = self._staging
        self._writer = tf.summary.create_file_writer(target)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self._write("step", step, scalars)

    def epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        self._write("epoch", epoch, epoch_scalars(metrics))
        if self._writer is not None:
            self._writer.flush()
            self._upload()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._upload()
            if self._staging:
                shutil.rmtree(self._staging, ignore_errors=True)
            self._writer = None

    def _write(self, prefix: str, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            return
        import tensorflow as tf

        with self._writer.as_default(step=int(step)):
            for name, value in scalars.items():
                tf.summary.scalar(f"{prefix}/{name}", float(value))

    def _upload(self) -> None:
        if not self._staging:
            return
        import pyarrow.fs

        # Event files only grow, so copying the whole (small) directory is simple and correct.
        pyarrow.fs.copy_files(self._staging, self.logdir)
