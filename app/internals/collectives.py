"""TensorFlow's private API for collectives across workers outside a tf.distribute scope (app.training.collective,
app.training.stall_watch), behind the same door as app.internals: the only place app/ touches these names, checked
against the installed TensorFlow by tests/test_internals.py. A leaf: libraries imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Callable

# MultiWorkerMirroredStrategy's own all-reduce is ``collective_ops.all_reduce_v2`` (tensorflow/python/distribute/
# cross_device_utils.py, CollectiveReplicaLauncher). TensorFlow publishes no collective op outside a strategy;
# ``tf.raw_ops.CollectiveReduceV2`` is the same kernel with every argument spelled out; these fill them as MWMS does.
# With no timeout: the kernel's timeout starts a thread per op that sleeps the whole timeout even once the op is
# done (thousands of threads a minute at a fast step's rate, until the process can start none); the wait on a peer
# is bounded by aborting or cancelling them instead (``abort_eager``, ``cancellable``), as MWMS's own health check does.


def all_reduce(tensor: Any, group_size: int, group_key: int, instance_key: int) -> Any:
    """Sum of ``tensor`` over the ``group_size`` workers whose op has the same group and instance key."""
    from tensorflow.python.ops import collective_ops as ops

    return ops.all_reduce_v2(tensor, group_size, group_key, instance_key, "Add", "Id")


def all_gather(tensor: Any, group_size: int, group_key: int, instance_key: int) -> Any:
    """Every worker's ``tensor`` concatenated along its first axis, in rank order (CPUs: ring; GPUs: NCCL)."""
    from tensorflow.python.ops import collective_ops as ops

    return ops.all_gather_v2(tensor, group_size, group_key, instance_key)


def all_to_all(tensor: Any, group_size: int, group_key: int, instance_key: int) -> Any:
    """Row ``j`` of every worker's ``tensor`` (``group_size`` rows) to worker ``j``: a reduce-scatter, once summed
    (``CollectiveReduceScatterV2`` is NCCL's only in TensorFlow 2.21; its all-to-all runs on CPUs too)."""
    from tensorflow.python.ops import collective_ops as ops

    return ops.all_to_all_v2(tensor, group_size, group_key, instance_key)


def abort_eager(message: str) -> None:
    """Every collective this process runs eagerly (a host sum), waiting or to come, fails with "Collective ops is
    aborted by: ``message``": the eager context's ``abort_collective_ops``, which MultiWorkerMirroredStrategy's health
    check calls. It does not reach the collectives inside a traced function (a step's): ``cancellable`` does."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


def cancellable() -> tuple[Any, Callable[[], None]]:
    """A context inside which every traced function this process calls is cancellable, and the call that cancels
    them, for good: a collective waiting inside one fails ("group is cancelled"). TensorFlow's eager runtime runs a
    function under the cancellation manager its ``cancellation`` module holds (``context.call_function``)."""
    from tensorflow.python.eager import cancellation

    manager = cancellation.CancellationManager()
    return cancellation.CancellationManagerContext(manager), manager.start_cancel


# A MirroredStrategy's all-reduces (CollectiveAllReduce over CPUs or GPUs) take group keys counted up from
# ``1 + MirroredStrategy._collective_key_base`` and instance keys from 100 within a group: a second strategy in one
# process (app.fit called twice) reuses the first's keys, and TensorFlow binds a key to the shape it first reduced
# ("Shape mismatch in the collective instance 100"). Each strategy made through here takes a base of its own, as
# TensorFlow's own tests do (tensorflow/python/distribute/strategy_combinations.py).
KEY_BASE_STEP = 100_000


def mirrored_strategy(devices: Any) -> Any:
    """``tf.distribute.MirroredStrategy(devices)`` whose collective keys no other strategy of this process uses."""
    import tensorflow as tf
    from tensorflow.python.distribute import mirrored_strategy as mirrored_lib

    mirrored_lib.MirroredStrategy._collective_key_base += KEY_BASE_STEP
    return tf.distribute.MirroredStrategy(devices)
