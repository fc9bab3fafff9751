"""How wide a run is and what stays fixed when that changes: ``--num-workers N`` or ``MIN:MAX`` (an elastic run),
``--global-batch`` (the batch kept at every size), ``--checkpoint-every-steps``; parsed and checked here, for
the config's cross-field rules (app.config)."""

from __future__ import annotations

import math
from typing import Any

WORKERS_FORMAT = "N or MIN:MAX (for example 2, or 1:4)"
# An elastic run's restarts when --max-failures is not given: a lost node is expected there, and Ray Train counts
# it as a failure, and usually one more when it first tries to start a group of the old size (its start times out).
ELASTIC_RESTARTS = 10


def parse_workers(value: Any) -> Any:
    """``--num-workers``/``num_workers`` as typed (2, "2", "1:4", (1, 4), [1, 4]) -> an int, or a (min, max) tuple
    for a range; a range of one size is that size. Anything else raises ValueError in one line."""
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"takes {WORKERS_FORMAT}")
        value = tuple(int(p) for p in parts) if len(parts) == 2 else int(parts[0])
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"takes {WORKERS_FORMAT}")
        low, high = value
        if min(low, high) < 1:  # checked first: swapping a range with a 0 in it gives another bad range
            raise ValueError(f"{'MIN' if low < 1 else 'MAX'} {min(low, high)} must be at least 1")
        if low > high:
            raise ValueError(f"MIN {low} is larger than MAX {high}; give {high}:{low}")
        return low if low == high else (low, high)
    return value


def describe(num_workers: Any) -> str:
    """2, or 1:4: as --num-workers takes it."""
    return str(num_workers) if isinstance(num_workers, int) else ":".join(map(str, num_workers))


def sizes(num_workers: Any) -> range:
    """Every worker count the run may have (``num_workers`` as typed or as parsed)."""
    num_workers = parse_workers(num_workers)
    low, high = (num_workers, num_workers) if isinstance(num_workers, int) else num_workers
    return range(low, high + 1)


def split_problem(global_batch: int, grad_accum: int, counts: range, unit: str = "worker") -> str | None:
    """Why ``global_batch`` does not split into equal per-replica batches at some worker count, naming the sizes
    that do and the nearest batches that split at every count; None when it splits at each."""
    bad = [n for n in counts if global_batch % (n * grad_accum)]
    if not bad:
        return None
    works = [n for n in counts if n not in bad]
    step = math.lcm(*(n * grad_accum for n in counts))
    below, above = global_batch // step * step, (global_batch // step + 1) * step
    nearest = f"{below} or {above}" if below else str(above)
    accum = f" x {grad_accum} accumulated micro-batches" if grad_accum > 1 else ""
    return (f"--global-batch {global_batch} does not split evenly over {', '.join(map(str, bad))} {unit}(s){accum} "
            f"(every step's batch is split into equal parts, one per {unit}); "
            + (f"it does over {', '.join(map(str, works))}; " if works else "")
            + f"use --global-batch {nearest}, which splits at every size from {counts[0]} to {counts[-1]}")
