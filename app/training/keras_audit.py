"""--audit-sample-ids on Keras's fit: the ids of the rows every worker's input handed to fit() each epoch.

Each worker's training input records the ids of the rows it delivers (``IdLog.record``: arrays by their row id, a
given id or the row's position in x; streamed files by the content hash of app.data.blocks), as fit() reads them.
At every epoch's end ``AuditIds`` gathers every worker's ids in rank order (an exact int64 gather, not a float sum)
and rank 0 keeps them in the run's state (its checkpoints, so a resumed run keeps the epochs before it); the run
writes them to ``audit_sample_ids.json``, one list per epoch, and result.json's ``audit`` says, per epoch, how many
ids were trained and how many distinct ones: each row once an epoch is ``seen == unique == rows - dropped``.
"""

from __future__ import annotations

import threading
from typing import Any

import keras
import numpy as np

from app.training.collective import Collective

STATE_KEY = "audit_sample_ids"


class IdLog:
    """The ids a worker's input delivered in the epoch under way (tf.data may call ``record`` from its threads)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._lock = threading.Lock()

    def record(self, ids: Any) -> Any:
        with self._lock:
            self._parts.append(np.asarray(ids, dtype=np.int64).ravel().copy())
        return ids

    def take(self) -> np.ndarray:
        """The epoch's ids so far, in the order they were delivered, and a fresh log."""
        with self._lock:
            parts, self._parts = self._parts, []
        return np.concatenate(parts) if parts else np.zeros((0,), np.int64)


def gather_ids(collective: Collective, ids: np.ndarray) -> np.ndarray:
    """Every worker's ``ids`` (any lengths), concatenated in rank order, exact for all 64 bits."""
    if collective.world == 1:
        return ids
    import tensorflow as tf

    lengths = collective.gather(np.array([ids.size])).ravel().astype(np.int64)
    padded = np.zeros((int(lengths.max()),), np.int64)
    padded[:ids.size] = ids
    every = collective.gather_tensor(tf.constant(padded.reshape(1, -1))).numpy()
    return np.concatenate([every[rank, :n] for rank, n in enumerate(lengths)])


def summary(per_epoch: list[list[int]]) -> list[dict[str, int]]:
    """result.json's ``audit``: per epoch, the ids trained and the distinct ones."""
    return [{"epoch": e + 1, "seen": len(ids), "unique": len(set(ids))} for e, ids in enumerate(per_epoch)]


class AuditIds(keras.callbacks.Callback):
    """Every epoch's ids over every worker, kept by rank 0 in ``state[STATE_KEY]`` (before Checkpoints, which
    saves that state). Every worker takes part in the gather."""

    def __init__(self, log: IdLog, collective: Collective, state: dict[str, Any], rank: int) -> None:
        super().__init__()
        self.log, self.collective, self.state, self.rank = log, collective, state, rank

    def on_epoch_begin(self, epoch, logs=None):
        self.log.take()  # an epoch's ids only (not a pass fit() made and left unread)

    def on_epoch_end(self, epoch, logs=None):
        every = gather_ids(self.collective, self.log.take())
        if self.rank == 0:
            kept = self.state.setdefault(STATE_KEY, [])
            del kept[epoch:]  # a restarted worker trains its epochs again from its checkpoint's
            kept.extend([[]] * (epoch - len(kept)))  # epochs trained before the audit was asked for: empty lists
            kept.append(every.tolist())
