"""Sums across Ray workers with TensorFlow's collective ops, outside any tf.distribute scope.

MultiWorkerMirroredStrategy is created in each worker only to configure the
cluster's collectives (from TF_CONFIG, before any other TensorFlow op); the
model, its optimizers and Keras's own step then run under the default strategy,
one replica per worker, exactly as ``model.fit`` runs them in one process. What
crosses workers goes through the same collective all-reduce MWMS uses inside
(``CollectiveReduceV2``, ring over gRPC on CPUs, NCCL on GPUs), called here
directly:

- in a traced step (``in_graph``): a model's gradients, once per optimizer step;
- on the host (``host``): metric states, batch-norm statistics and callback
  decisions, a few times per epoch.

Each call site has a fixed instance key (``Site``): every worker traces the same
steps in the same order, so a key names the same all-reduce everywhere, also
after a retrace (a short last batch).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Optional

import numpy as np

GROUP_KEY = 4242  # one group: every worker's device; MWMS's own groups count up from 1


class Site(IntEnum):
    """Every all-reduce of a run, one key each (an optimizer's gradients: GRADIENTS + its index)."""

    METRICS = 1
    STATE = 2
    DECISIONS = 3
    GRADIENTS = 100


class Collective:
    """All-reduce (sum) over ``world`` workers; with one worker every sum is the value itself."""

    def __init__(self, world: int, timeout_s: Optional[float] = None):
        self.world = world
        self.timeout_s = timeout_s or 0  # 0: wait as long as it takes (--stall-timeout-s bounds it)

    def in_graph(self, tensor, site: int):
        """Sum of a tensor over every worker, inside a traced function."""
        if self.world == 1:
            return tensor
        from app import internals

        return internals.collective_sum(tensor, self.world, GROUP_KEY, int(site), self.timeout_s)

    def host(self, values: np.ndarray, site: int) -> np.ndarray:
        """Sum of a host vector over every worker (float64, exact for counts)."""
        values = np.asarray(values, dtype=np.float64)
        if self.world == 1:
            return values
        import tensorflow as tf

        return self.in_graph(tf.constant(values), site).numpy()
