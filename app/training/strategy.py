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


# The name a run records for TensorFlow's default strategy: one replica, no tf.distribute scope of its own.
ONE_REPLICA = "default strategy (one replica)"


def one_replica() -> "tf.distribute.Strategy":
    """One replica where TensorFlow places ops by default (the first GPU, else the CPU): the default strategy, what
    a plain Keras script runs under.

    Not OneDeviceStrategy, nor MWMS with one worker: under either scope a compiled Keras step runs at half to
    two thirds of its speed on a CPU (Keras's own model.fit: 3,497-3,728 samples/s plainly, 1,254-1,282 under
    OneDeviceStrategy; a 1-worker Ray run: 1,620-1,888 under MWMS, 2,767-3,136 without; BENCHMARKS.md, "A compiled
    Keras model"). With one replica there is nothing to all-reduce, and the default strategy's run, reduce, gather
    and datasets compute the same values.
    """
    import tensorflow as tf

    return tf.distribute.get_strategy()


def name_of(strategy: "tf.distribute.Strategy") -> str:
    """The strategy's name for the plan and result.json: its class, or ONE_REPLICA for the default strategy."""
    import tensorflow as tf

    return ONE_REPLICA if strategy is tf.distribute.get_strategy() else type(strategy).__name__


def ray_strategy_name(num_workers: int) -> str:
    """What ``ray_worker_strategy`` builds in a group of ``num_workers``, named before any worker starts."""
    return "MultiWorkerMirroredStrategy" if num_workers > 1 else ONE_REPLICA


def ray_worker_strategy(cpus_per_worker: float, stall_timeout_s: float | None,
                        num_workers: int) -> "tf.distribute.Strategy":
    """A Ray Train worker's strategy: MWMS in a group, one replica when alone (nothing to all-reduce, and MWMS's
    scope would halve a compiled step: ``one_replica``). Call it before any other TensorFlow op."""
    if num_workers > 1:
        return multi_worker_strategy(cpus_per_worker, stall_timeout_s)
    set_thread_counts(cpus_per_worker)
    return one_replica()


def multi_worker_strategy(cpus_per_worker: float, stall_timeout_s: float | None = None) -> "tf.distribute.Strategy":
    """MWMS for a Ray Train worker. Call it before any other TensorFlow op.

    Collectives must be configured at program start-up, so this is the first
    thing the worker does with TensorFlow. With ``stall_timeout_s`` every
    collective fails (DeadlineExceeded) when a peer does not join it in time:
    a frozen worker (SIGSTOP, a stuck device, a partition) ends the run or
    triggers a restart instead of leaving the others waiting forever.
    """
    import tensorflow as tf

    threads = set_thread_counts(cpus_per_worker)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=stall_timeout_s)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    log.debug(
        "MultiWorkerMirroredStrategy: %d replicas in sync, %d TF threads per worker",
        strategy.num_replicas_in_sync,
        threads,
    )
    return strategy


# --------------------------------------------------------------------------- #
# Local (no Ray): Mirrored, TPU, one device, central storage, pipeline stages   #
# --------------------------------------------------------------------------- #


class StrategyUnavailable(Exception):
    """An explicit strategy request that this machine cannot meet."""


def _split_cpu(devices: int) -> None:
    """Split the CPU into ``devices`` logical devices, so MirroredStrategy really runs N replicas."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)


def _find_tpu():
    """The TPU cluster resolver if a TPU is reachable, else (None, why not)."""
    import tensorflow as tf

    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return resolver, ""
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__


def local_strategy(name: str, devices: int | None, cpus: float | None = None) -> tuple["tf.distribute.Strategy", str]:
    """The strategy for ``--backend local`` and the reason it was chosen.

    ``auto``: TPU if one resolves, else all GPUs (Mirrored if 2+, one device if
    1), else the CPU (Mirrored over ``--devices`` logical CPUs if N > 1, else
    one CPU device). An explicit request that cannot be met raises
    StrategyUnavailable naming what was found; nothing falls back silently.
    """
    import tensorflow as tf

    if cpus:
        set_thread_counts(cpus)
    gpus = tf.config.list_physical_devices("GPU")
    if devices is not None and devices > 1:
        if gpus:
            raise StrategyUnavailable(f"--devices splits the CPU, but {len(gpus)} GPU(s) were found: drop --devices")
        _split_cpu(devices)
    cpu_devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    gpu_devices = [d.name for d in tf.config.list_logical_devices("GPU")]
    compute = gpu_devices or cpu_devices
    found = f"{len(gpu_devices)} GPU(s), {len(cpu_devices)} CPU device(s)"

    if name == "tpu" or name == "auto":
        resolver, why_not = _find_tpu()
        if resolver is not None:
            return tf.distribute.TPUStrategy(resolver), f"a TPU resolved ({resolver.master()})"
        if name == "tpu":
            raise StrategyUnavailable(f"--strategy tpu: no TPU found ({why_not}); found {found}")

    if name == "auto":
        if len(gpu_devices) >= 2:
            return tf.distribute.MirroredStrategy(gpu_devices), f"no TPU; {len(gpu_devices)} GPUs -> MirroredStrategy"
        if len(gpu_devices) == 1:
            return one_replica(), "no TPU; 1 GPU -> one replica on it"
        if len(cpu_devices) >= 2:
            return (
                tf.distribute.MirroredStrategy(cpu_devices),
                f"no TPU, no GPU; --devices {len(cpu_devices)} logical CPUs -> MirroredStrategy",
            )
        return one_replica(), "no TPU, no GPU -> one replica on the CPU"

    if name == "mirrored":
        if len(compute) < 2:
            raise StrategyUnavailable(
                f"--strategy mirrored needs 2 or more devices, found {found}: "
                "use --devices N to split the CPU, or --strategy one-device"
            )
        return tf.distribute.MirroredStrategy(compute), f"requested; {len(compute)} devices"
    if name == "one-device":
        return one_replica(), f"requested; on {compute[0]}"
    if name == "central-storage":
        if len(compute) < 2:
            raise StrategyUnavailable(
                f"--strategy central-storage needs 2 or more compute devices, found {found}: "
                "use --devices N to split the CPU"
            )
        return (
            tf.distribute.experimental.CentralStorageStrategy(compute, parameter_device=cpu_devices[0]),
            f"requested; variables on {cpu_devices[0]}, compute on {len(compute)} devices",
        )
    if name == "pipeline":
        # Not a tf.distribute strategy: the default one feeds the data; app.training.pipeline places the stages.
        if len(compute) < 2:
            raise StrategyUnavailable(
                f"--strategy pipeline needs 2 or more devices (one per stage), found {found}: "
                "use --devices N to split the CPU"
            )
        return tf.distribute.get_strategy(), f"requested; {len(compute)} stages, one per device"
    raise StrategyUnavailable(f"unknown strategy {name!r}")


def stage_devices() -> list[str]:
    """One device per pipeline stage: every GPU, else every logical CPU (after ``local_strategy``)."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")]
