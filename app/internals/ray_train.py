"""Ray Train's trainer less its Ray Data actor on runs that hand it no dataset (app.backends.tf_config), behind the
same door as app.internals: checked against the installed Ray by tests/test_internals.py. A leaf: Ray imported
inside the function.

Ray Train 2.60 makes a ``DatasetsCallback`` on every run (``DataParallelTrainer._create_default_callbacks``), and
that callback starts a ``DatasetManager`` actor, a process that imports Ray Data, as the workers start, datasets or
none. On 2 cores it competes with the workers' import of TensorFlow: ~1.1 s of every run's start (docs/design.md,
facts). Ray has no switch for it. Without datasets there is no shard to hand out, and no worker reads the
DataContext the callback would copy to it.
"""

from __future__ import annotations

from typing import Optional

_TRAINER: list[Optional[type]] = [None]  # made once: one class for every run of this process


def data_parallel_trainer() -> type:
    """A ``DataParallelTrainer`` whose runs without datasets start no ``DatasetManager``; the same otherwise."""
    if _TRAINER[0] is not None:
        return _TRAINER[0]
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    class Trainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return callbacks if self.datasets else [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    _TRAINER[0] = Trainer
    return Trainer
