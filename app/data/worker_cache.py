"""A worker's part of cached streamed data, kept in its memory after its first whole pass (app.data.keras_stream).

Kept only once the pass is known whole, so a pass cut short (a restart) reads the split again; every worker of a
split keeps its part in the same epoch, because a split's next epoch begins only when every worker's iterator asks
for it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def keeping(batches, kept: Optional[dict[str, Any]], rows: Optional[int]):
    """``batches`` as they come; with ``kept``, their rows kept there too once the pass is whole: at its end, or
    before its last batch is handed on when the pass's ``rows`` are known (fit() stops reading after its last
    step, before the pass's end; nothing is read ahead: an equal split's end waits on the other workers' reads)."""
    parts: list[dict[str, np.ndarray]] = []

    def keep() -> None:
        # A pass of no rows is kept too: every worker must stop reading the split together (a split's epoch
        # begins when every worker's iterator asks for it).
        kept["rows"] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}

    seen = 0
    for batch in batches:
        if kept is not None:
            parts.append(batch)
            seen += len(next(iter(batch.values())))
            if seen == rows:
                keep()
                kept = None
        yield batch
    if kept is not None:
        keep()


def batches(kept: dict[str, np.ndarray], size: int, seed: int, rank: int, shuffle: bool):
    """One pass of a worker's kept rows in batches of ``size`` (the last short, as the shard's were), in a new
    seeded order each epoch when ``shuffle``."""
    rows = len(next(iter(kept.values()))) if kept else 0
    order = np.random.default_rng([seed, rank]).permutation(rows) if shuffle else np.arange(rows)
    for start in range(0, rows, size):
        index = order[start:start + size]
        yield {k: v[index] for k, v in kept.items()}
