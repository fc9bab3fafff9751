"""The Ray cluster a run uses: join the one RAY_ADDRESS names or start a local one, sized and checked."""

from __future__ import annotations

import logging
import os

from app.config import TrainConfig
from app.errors import UserError

log = logging.getLogger(__name__)


def _joining_a_cluster() -> bool:
    import ray

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


def cpus_needed(config: TrainConfig) -> float:
    """CPUs the run's workers (and parameter servers) reserve."""
    ps = config.num_ps * config.cpus_per_ps if config.strategy == "parameter-server" else 0
    return config.num_workers * config.cpus_per_worker + ps


def check_fits_locally(config: TrainConfig) -> None:
    """Refuse, before anything starts, a run that the local Ray we would start cannot hold."""
    if _joining_a_cluster():
        return  # a real cluster may autoscale: connect() says we are waiting instead
    cpus = os.cpu_count() or 1
    need_cpus = cpus_needed(config)
    if need_cpus > cpus:
        servers = (f" + {config.num_ps} parameter servers x {config.cpus_per_ps:g}"
                   if config.strategy == "parameter-server" else "")
        raise UserError(
            f"{config.num_workers} workers x {config.cpus_per_worker:g}{servers} CPUs need {need_cpus:g} CPUs, but "
            f"this machine has {cpus}: lower --num-workers or --cpus-per-worker"
            f"{', --num-ps or --cpus-per-ps' if servers else ''}, or set RAY_ADDRESS to use a cluster"
        )
    if config.use_gpu:
        raise UserError("--use-gpu needs GPUs, and the local Ray started here has none: set RAY_ADDRESS to a GPU cluster")


def connect(config: TrainConfig) -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit` too), or start a local one.

    On a real cluster, more workers than the CPUs free now is legitimate (the
    autoscaler adds nodes): we say that we are waiting, and the worker start
    timeout bounds the wait.
    """
    import ray

    if ray.is_initialized():  # the caller (a notebook, a test) already chose the cluster
        return
    # Ray 2.60 warns on every start or join that token authentication is on (its default): not for our console.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(logging_level=logging.WARNING)
        except ray.exceptions.AuthenticationError:
            raise UserError(
                f"the Ray cluster at {os.environ['RAY_ADDRESS']} refused our authentication token: set "
                "RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            ) from None
        free = ray.available_resources()
        need_cpus = cpus_needed(config)
        need_gpus = config.num_workers if config.use_gpu else 0
        if need_cpus > free.get("CPU", 0) or need_gpus > free.get("GPU", 0):
            log.warning(
                "the cluster has %.1f CPUs / %.0f GPUs free now; this run needs %.1f CPUs / %d GPUs. "
                "Waiting up to %.0f s for them (--worker-start-timeout-s).",
                free.get("CPU", 0), free.get("GPU", 0), need_cpus, need_gpus, config.worker_start_timeout_s,
            )
        return
    # address="local": always a new local Ray, never a stale `ray start` cluster
    # found through /tmp/ray (joining is what RAY_ADDRESS is for).
    # One logical CPU beyond the workers' for Ray Data's tasks (streamed files):
    # without it, workers holding every CPU leave Ray Data waiting forever (DESIGN.md).
    # The dashboard stays on: Train V2's placement-group cleaner uses its state API.
    ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 1, logging_level=logging.WARNING)


# Ray Data's read and preprocessing tasks each take one CPU; with none free
# beside the workers, a streamed epoch waits forever (DESIGN.md).
READ_CPUS = 1


def check_room_for_reads(config: TrainConfig) -> None:
    """Streamed data: refuse, before training, a cluster whose CPUs the workers would fill completely."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    workers = config.num_workers * config.cpus_per_worker
    if total < workers + READ_CPUS:
        raise UserError(
            f"streamed data needs {READ_CPUS} CPU for Ray Data's reads beside the workers' {workers:g}, but the "
            f"cluster has {total:g} CPUs ({workers + READ_CPUS - total:g} missing): lower --cpus-per-worker to "
            f"{max(total - READ_CPUS, 0.1) / config.num_workers:.2g} or --num-workers, add a node, or use "
            "in-memory data (.npz files, data functions returning arrays), which needs no Ray Data task"
        )


_NODE_ID_WIDTH = 64  # Ray node ids are 56 hex characters


def worker_nodes(strategy, node_id: str, world: int) -> list[str]:
    """Every worker's Ray node id, in rank order, from an all-gather of the ids as fixed-width codes.

    Ray Train has no all-gather of Python objects (only a broadcast from rank
    0), and this runs once, so one small TensorFlow collective is the simplest.
    """
    import numpy as np
    import tensorflow as tf

    code = np.frombuffer(node_id.encode().ljust(_NODE_ID_WIDTH)[:_NODE_ID_WIDTH], dtype=np.uint8).astype(np.int32)
    values = strategy.experimental_distribute_values_from_function(lambda _: tf.constant(code[None, :]))
    rows = strategy.gather(values, axis=0).numpy()
    # A worker with several local replicas contributes one row per replica.
    return [bytes(row.astype(np.uint8)).decode().strip() for row in rows[:: len(rows) // world]]
