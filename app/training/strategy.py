"""Which tf.distribute strategy runs the loop, and why.

In a Ray Train worker it is the default strategy, one replica per worker: the
step runs as it runs in one process, and what crosses workers (the gradients,
the metric sums) goes through TensorFlow's collective all-reduce called
directly (app.training.collective). MultiWorkerMirroredStrategy is still made
first, to read TF_CONFIG and configure the cluster's collectives; nothing runs
in its scope. Locally: MirroredStrategy, TPUStrategy, one device.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.internals import collectives

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
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # Two inter-op threads: one can wait on a collective while another computes.
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    except RuntimeError as e:
        # This process's TensorFlow started already (the driver built the user's model to see which step it
        # brings, then found the run is the product's): its thread pools stay as they are, which only costs speed.
        log.debug("thread counts left as TensorFlow set them: %s", e)
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


@dataclass(frozen=True)
class LocalReplicas:
    """A local strategy of several replicas that Keras's fit trains under, and why it was chosen."""

    strategy: Any  # tf.distribute.Strategy
    reason: str

    @property
    def replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def name(self) -> str:
        return name_of(self.strategy)


def name_of(strategy: "tf.distribute.Strategy") -> str:
    """The strategy's name for the plan and result.json: its class, or ONE_REPLICA for the default strategy."""
    import tensorflow as tf

    return ONE_REPLICA if strategy is tf.distribute.get_strategy() else type(strategy).__name__


# What a Ray run of several workers records as its strategy (the plan, result.json).
RAY_WORKERS = "collective all-reduce (one replica per worker)"


def ray_strategy_name(num_workers: int) -> str:
    """What ``ray_worker_strategy`` trains under in a group of ``num_workers``, named before any worker starts."""
    return RAY_WORKERS if num_workers > 1 else ONE_REPLICA


def ray_strategy_reason(num_workers: int) -> str:
    """Why a Ray run of ``num_workers`` trains so (result.json's strategy_reason)."""
    return "Ray Train workers: one replica each, gradients all-reduced across workers" if num_workers > 1 \
        else "one Ray Train worker: one replica, nothing to all-reduce"


def one_replica_reason() -> str:
    """Why a run in this process without Ray trains one replica (result.json's strategy_reason): where TensorFlow's
    default strategy places it."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return f"Keras's fit in this process: one replica on {gpus[0].name}" if gpus else \
        "no TPU, no GPU -> one replica on the CPU"


_COLLECTIVES: list = []  # the MWMS that configured this process's collectives, kept for the process's life


def ray_worker_strategy(cpus_per_worker: float, stall_timeout_s: float | None,
                        num_workers: int, tensor_degree: int | None = None) -> "tf.distribute.Strategy":
    """A Ray Train worker's strategy: the default one (``one_replica``). In a group, MultiWorkerMirroredStrategy
    is made first to configure the collectives that app.training.collective calls; its scope would cost a CPU
    step half to two thirds of its speed (``one_replica``), so nothing runs in it. With ``tensor_degree``
    (--tensor-parallel N) the worker's devices for the shards come first (``tensor_devices``): the CPU is split
    before MWMS starts this process's TensorFlow. Call it before any other TensorFlow op."""
    if tensor_degree:
        split_for_tensor_parallel(tensor_degree)  # the devices are listed later: listing starts TensorFlow
    if num_workers > 1:
        _COLLECTIVES.append(multi_worker_strategy(cpus_per_worker, stall_timeout_s))
    else:
        set_thread_counts(cpus_per_worker)
    return one_replica()


def multi_worker_strategy(cpus_per_worker: float, stall_timeout_s: float | None = None) -> "tf.distribute.Strategy":
    """MWMS for a Ray Train worker: TF_CONFIG read, this worker's server started, collectives configured. Call it
    before any other TensorFlow op ("Collective ops must be configured at program startup"). With
    ``stall_timeout_s`` a collective of MWMS's own (its few at start-up) fails when a peer does not join it in time;
    the steps' and host sums' all-reduces are bounded by app.training.stall_watch instead (a timeout per op starts a
    thread per op)."""
    import tensorflow as tf

    threads = set_thread_counts(cpus_per_worker)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=stall_timeout_s)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    log.debug("MultiWorkerMirroredStrategy: %d replicas in sync, %d TF threads per worker",
              strategy.num_replicas_in_sync, threads)
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
    if len(tf.config.get_logical_device_configuration(cpu) or []) == devices:  # split so already in this process
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    except RuntimeError:  # "Virtual devices cannot be modified after being initialized"
        raise StrategyUnavailable(f"--devices {devices} splits this process's CPU before TensorFlow starts, and "
                                  "TensorFlow has started here already: run it in a fresh process (python "
                                  "jobs/train.py, or app.train first thing in a script)") from None


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
    if name not in _LOCAL:
        raise StrategyUnavailable(f"unknown strategy {name!r}")
    return _LOCAL[name](_Devices.found())


@dataclass(frozen=True)
class _Devices:
    cpu: list[str]
    gpu: list[str]

    @classmethod
    def found(cls) -> "_Devices":
        import tensorflow as tf

        return cls([d.name for d in tf.config.list_logical_devices("CPU")],
                   [d.name for d in tf.config.list_logical_devices("GPU")])

    @property
    def compute(self) -> list[str]:
        return self.gpu or self.cpu

    def __str__(self) -> str:
        return f"{len(self.gpu)} GPU(s), {len(self.cpu)} CPU device(s)"

    def at_least_two(self, request: str, for_what: str = "devices", other: str = "") -> list[str]:
        if len(self.compute) < 2:
            raise StrategyUnavailable(f"--strategy {request} needs 2 or more {for_what}, found {self}: "
                                      f"use --devices N to split the CPU{other}")
        return self.compute


def _tpu(found: _Devices):
    import tensorflow as tf

    resolver, why_not = _find_tpu()
    if resolver is None:
        raise StrategyUnavailable(f"--strategy tpu: no TPU found ({why_not}); found {found}")
    return tf.distribute.TPUStrategy(resolver), f"a TPU resolved ({resolver.master()})"


def _auto(found: _Devices):
    import tensorflow as tf

    resolver, _ = _find_tpu()
    if resolver is not None:
        return tf.distribute.TPUStrategy(resolver), f"a TPU resolved ({resolver.master()})"
    if len(found.gpu) >= 2:
        return collectives.mirrored_strategy(found.gpu), f"no TPU; {len(found.gpu)} GPUs -> MirroredStrategy"
    if len(found.gpu) == 1:
        return one_replica(), "no TPU; 1 GPU -> one replica on it"
    if len(found.cpu) >= 2:
        return (collectives.mirrored_strategy(found.cpu),
                f"no TPU, no GPU; --devices {len(found.cpu)} logical CPUs -> MirroredStrategy")
    return one_replica(), "no TPU, no GPU -> one replica on the CPU"


def _mirrored(found: _Devices):
    compute = found.at_least_two("mirrored", other=", or --strategy one-device")
    return collectives.mirrored_strategy(compute), f"requested; {len(compute)} devices"


def _central_storage(found: _Devices):
    import tensorflow as tf

    compute = found.at_least_two("central-storage", "compute devices")
    return (tf.distribute.experimental.CentralStorageStrategy(compute, parameter_device=found.cpu[0]),
            f"requested; variables on {found.cpu[0]}, compute on {len(compute)} devices")


def _pipeline(found: _Devices):
    import tensorflow as tf

    # Not a tf.distribute strategy: the default one feeds the data; app.training.pipeline places the stages.
    compute = found.at_least_two("pipeline", "devices (one per stage)")
    return tf.distribute.get_strategy(), f"requested; {len(compute)} stages, one per device"


# --strategy (--backend local) -> its builder; each raises StrategyUnavailable for a request this machine
# cannot meet.
_LOCAL = {
    "auto": _auto,
    "tpu": _tpu,
    "mirrored": _mirrored,
    "one-device": lambda found: (one_replica(), f"requested; on {found.compute[0]}"),
    "central-storage": _central_storage,
    "pipeline": _pipeline,
}


def tensor_devices(n: int) -> list[str]:
    """The N devices of this process that --tensor-parallel N's shards live on: the first N GPUs, else the CPU split
    into N logical devices (before TensorFlow initialises its devices)."""
    split_for_tensor_parallel(n)
    found = _Devices.found()
    if len(found.compute) < n:
        raise StrategyUnavailable(f"--tensor-parallel {n} needs {n} devices, found {found}")
    return list(found.compute[:n])


def split_for_tensor_parallel(n: int) -> None:
    """No GPU: the CPU split into N logical devices, unless this process's TensorFlow has started already (an
    earlier run in it: ``tensor_devices`` counts what it has)."""
    import contextlib

    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        with contextlib.suppress(StrategyUnavailable):
            _split_cpu(n)


def stage_devices() -> list[str]:
    """One device per pipeline stage: every GPU, else every logical CPU (after ``local_strategy``)."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")]
