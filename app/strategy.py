"""Which tf.distribute strategy runs the loop, and why.

In a Ray Train worker it is always MultiWorkerMirroredStrategy: Ray sets
TF_CONFIG, one replica per worker, gradients all-reduced across workers.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

log = logging.getLogger(__name__)


def set_thread_counts(cpus: float) -> int:
    """Give TensorFlow as many compute threads as CPUs reserved.

    Must run before any strategy exists ("Intra op parallelism cannot be
    modified after initialization"); Ray only sets OMP_NUM_THREADS, and TF's
    default (all cores) oversubscribes a node shared by several workers.
    """
    import tensorflow as tf

    threads = max(1, math.ceil(cpus))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    # Two inter-op threads: one can wait on a collective while another computes.
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    return threads


def multi_worker_strategy(cpus_per_worker: float) -> "tf.distribute.Strategy":
    """MWMS for a Ray Train worker. Call it before any other TensorFlow op.

    Collectives must be configured at program start-up, so this is the first
    thing the worker does with TensorFlow.
    """
    import tensorflow as tf

    threads = set_thread_counts(cpus_per_worker)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    log.info(
        "MultiWorkerMirroredStrategy: %d replicas in sync, %d TF threads per worker",
        strategy.num_replicas_in_sync,
        threads,
    )
    return strategy
