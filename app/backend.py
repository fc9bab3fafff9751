"""Which backend runs a training, decided here once from ``--backend`` and ``--strategy``.

Everything that differs between the backends is a field of `Backend`: who starts the workers and where they
run, who keeps the checkpoints, how many replicas share a global batch before anything starts, whether Keras's
fit or the product's own loop trains it. The rest of the code reads these fields and never compares a backend's or a
strategy's name (``tests/test_architecture.py::test_backend_and_strategy_names_are_compared_in_three_modules``):
only this module, the config's cross-field rules (app.config) and the command line (app.cli) name them.
The driver that runs each backend is looked up by `Backend.name` (app.run.api).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from app.config import TrainConfig

BACKENDS = ("ray", "local")  # --backend: where the workers run (jobs/predict.py's --backend too)
PARAMETER_SERVER = "parameter-server"


@dataclass(frozen=True)
class Backend:
    name: str  # the driver: "ray" (Ray Train + MultiWorkerMirroredStrategy), "parameter-server", "local"
    on_ray: bool  # the workers are Ray processes: the run needs a cluster, files stream through Ray Data
    ray_train: bool  # Ray Train starts the workers and keeps the checkpoints (checkpoint_* in its storage)
    parameter_servers: bool  # asynchronous workers, each update one worker's batch, variables on PS actors
    pipeline: bool  # one model cut into stages over this process's devices
    # Replicas a global batch is split over, when known before anything starts (None: the devices decide).
    replicas: Optional[int]
    replicas_why: str
    counts_gpus: bool  # replicas is None because it is the GPUs found (else a TPU's cores or an elastic run's
    # workers: known once started)
    # The product's own training loop trains it, not Keras's fit: parameter servers (Keras 3's fit has no
    # ParameterServerStrategy). Every other run, a pipeline's too, trains by Keras's fit.
    own_loop: bool = False


def runs_on_ray(backend: str) -> bool:
    """``--backend`` (of training or of jobs/predict.py): True for Ray workers, False for this process."""
    return backend == "ray"


def backend_of(config: "TrainConfig") -> Backend:
    """The backend ``config`` asks for (its cross-field rules, app.config, have refused impossible pairs)."""
    strategy = config.strategy
    if runs_on_ray(config.backend) and strategy == PARAMETER_SERVER:
        return Backend(PARAMETER_SERVER, on_ray=True, ray_train=False, parameter_servers=True,
                       pipeline=False, replicas=1, replicas_why="--strategy parameter-server: each update is one "
                       "worker's batch", counts_gpus=False, own_loop=True)
    if runs_on_ray(config.backend):
        return Backend("ray", on_ray=True, ray_train=True, parameter_servers=False, pipeline=False,
                       # an elastic run's replicas follow the cluster, one per worker
                       replicas=None if config.elastic else config.max_workers,
                       replicas_why=f"{config.max_workers} Ray worker(s), one replica each", counts_gpus=False)
    one_replica = strategy in ("one-device", "pipeline")
    if config.tensor_degree:
        replicas, why = 1, f"--tensor-parallel {config.tensor_degree}: one replica, split over devices"
    elif one_replica:
        replicas, why = 1, f"--strategy {strategy}: one replica"
    elif config.devices:
        replicas, why = config.devices, f"--devices {config.devices}"
    else:
        replicas, why = None, "the devices found"
    return Backend("local", on_ray=False, ray_train=False, parameter_servers=False,
                   pipeline=strategy == "pipeline", replicas=replicas, replicas_why=why,
                   counts_gpus=replicas is None and strategy != "tpu")


def several_replicas_asked(config: "TrainConfig") -> bool:
    """Whether --strategy names a strategy of several local replicas (with --devices 1 the own step refuses it)."""
    return config.strategy in ("mirrored", "central-storage", "tpu")


def one_local_replica(config: "TrainConfig") -> bool:
    """Whether a run without Ray trains one replica, as a plain Keras script does (TensorFlow's default strategy):
    asked for (--strategy one-device), or what --strategy auto finds (no TPU, at most one GPU, no --devices split).
    Read from the physical devices: TensorFlow is not started, so a run that needs another strategy can still set
    its devices and threads."""
    backend = backend_of(config)
    if backend.on_ray or backend.pipeline or (backend.replicas or 1) > 1:
        return False
    if backend.replicas == 1:
        return True
    if config.strategy != "auto":
        return False
    import tensorflow as tf

    return not tf.config.list_physical_devices("TPU") and len(tf.config.list_physical_devices("GPU")) <= 1
