"""The Ray cluster a run uses: join the one RAY_ADDRESS names or start a local one, sized and checked."""

from __future__ import annotations

import logging
import os
import socket
import threading

from app.backend import backend_of
from app.config import TrainConfig
from app.errors import UserError
from app.internals.ray_auth import cluster_refusal

log = logging.getLogger(__name__)


def joining_a_cluster() -> bool:
    """Whether this process uses a Ray it did not start: RAY_ADDRESS, or one already initialised (a notebook)."""
    import ray

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


def cpus_needed(config: TrainConfig) -> float:
    """CPUs the run's workers (and parameter servers) reserve."""
    ps = config.num_ps * config.cpus_per_ps if backend_of(config).parameter_servers else 0
    return config.min_workers * config.cpus_per_worker + ps  # an elastic run starts with MIN


def fit_warnings(config: TrainConfig) -> list[str]:
    """--dry-run: why the local Ray would not hold the run, as a warning (the plan may be meant for a cluster)."""
    try:
        check_fits_locally(config)
    except UserError as e:
        return [f"warning: {e}"]
    return []


def check_fits_locally(config: TrainConfig) -> None:
    """Refuse, before anything starts, a run that the local Ray we would start cannot hold."""
    if joining_a_cluster():
        return  # a real cluster may autoscale: connect() says we are waiting instead
    cpus = os.cpu_count() or 1
    need_cpus = cpus_needed(config)
    if need_cpus > cpus:
        servers = (f" + {config.num_ps} parameter servers x {config.cpus_per_ps:g}"
                   if backend_of(config).parameter_servers else "")
        raise UserError(
            f"{config.min_workers} workers x {config.cpus_per_worker:g}{servers} CPUs need {need_cpus:g} CPUs, but "
            f"this machine has {cpus}: lower --num-workers or --cpus-per-worker"
            f"{', --num-ps or --cpus-per-ps' if servers else ''}, or set RAY_ADDRESS to use a cluster"
        )
    if config.use_gpu:
        raise UserError("--use-gpu needs GPUs, and the local Ray started here has none: set RAY_ADDRESS to a GPU cluster")
    memory = local_memory_gib()
    if config.memory_per_worker and config.min_workers * config.memory_per_worker > memory:
        raise UserError(
            f"{config.min_workers} workers x {config.memory_per_worker:g} GiB need "
            f"{config.min_workers * config.memory_per_worker:g} GiB, but the Ray started here can reserve "
            f"{memory:.1f} GiB: lower --memory-per-worker or --num-workers, or set RAY_ADDRESS to use a cluster")


def local_memory_gib() -> float:
    """GiB a Ray started on this machine can reserve for its workers (its ``memory`` resource): the available memory
    less the object store's default share of it (30 %); measured here: Ray's 16.3 GiB of 22.3 available."""
    import psutil

    return 0.7 * psutil.virtual_memory().available / 2**30


def connect_for_data(config: TrainConfig, reads: bool) -> TrainConfig:
    """``connect``, before the driver makes any Ray Dataset: Ray Data's progress bars off (datasets seal the
    current context when created; their bars are Ray's internals: read tasks, split coordinators), the console
    quiet again (importing Ray Data made its handler), and with ``reads`` (files to stream) room for read tasks.
    Returns the config to run: on this machine's own Ray, the workers sized to leave the reads their CPU
    (``room_for_reads``)."""
    connect(config, reads_for=None)
    if reads:
        config = room_for_reads(config)
    from ray.data import DataContext

    from app.ui import console

    DataContext.get_current().enable_progress_bars = config.show_logs
    console.quiet_now()
    return config


def _one_node_here() -> bool:
    """Whether the connected Ray is one node on this machine, not one RAY_ADDRESS names (a user's cluster)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    here = ray.util.get_node_ip_address()
    return not os.environ.get("RAY_ADDRESS") and len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == here


def room_for_reads(config: TrainConfig) -> TrainConfig:
    """Streamed data on a Ray of one node on this machine (the product's, or one the user's own first Ray Data call
    started), workers whose CPUs were not asked for: each takes its share of the CPUs Ray Data's reads leave
    (said once); anywhere else, the cluster's refusal (``check_room_for_reads``)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    if total >= config.max_workers * config.cpus_per_worker + READ_CPUS:
        return config
    share = int(100 * (total - READ_CPUS) / config.max_workers) / 100  # rounded down: the reads keep theirs
    if "cpus_per_worker" in config.model_fields_set or not _one_node_here() or share < 0.1:
        check_room_for_reads(config)
    log.info("resources: each of the %d workers takes %g CPU, leaving %d of this machine's Ray's %g for Ray Data's "
             "reads of the streamed data (--cpus-per-worker, cpus_per_worker= sets it)", config.max_workers, share,
             READ_CPUS, total)
    return config.model_copy(update={"cpus_per_worker": share})


def connect(config: TrainConfig, reads_for: str | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit` too), or start a local one.

    On a real cluster, more workers than the CPUs free now is legitimate (the
    autoscaler adds nodes): we say that we are waiting, and the worker start
    timeout bounds the wait. ``reads_for``: streamed files, read by Ray Data's tasks beside those workers (or
    actors): a cluster they would fill is refused (``check_room_for_reads``) before Ray Data reads a byte and
    before any waiting is said, whichever cluster it is.
    """
    import ray

    _wait_for_early_start()
    joined = not ray.is_initialized() and _join_or_start()  # else the caller (a notebook, a test) chose the cluster
    if reads_for is not None:
        check_room_for_reads(config, reads_for)
    if joined:
        _say_if_waiting(config)


def _join_or_start() -> bool:
    """True: joined the cluster RAY_ADDRESS names; False: started a local one."""
    import ray

    _quiet_token_notice()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # One call first (a GCS address: not "auto", not a ray:// client's): ray.init() takes 20 s to say that the
        # cluster refuses our token.
        if "://" not in address and address != "auto" and _refused_authentication(cluster_refusal(address)):
            raise _token_refused(address)
        try:
            ray.init(logging_level=logging.WARNING)
        except (ray.exceptions.AuthenticationError, ConnectionError) as e:
            if not _refused_authentication(e):
                raise
            raise _token_refused(address) from None
        return True
    _start_local()
    return False


def _say_if_waiting(config: TrainConfig) -> None:
    import ray

    free = ray.available_resources()
    need_cpus = cpus_needed(config)
    need_gpus = config.min_workers if config.use_gpu else 0
    if need_cpus > free.get("CPU", 0) or need_gpus > free.get("GPU", 0):
        log.warning(
            "the cluster has %.1f CPUs / %.0f GPUs free now; this run needs %.1f CPUs / %d GPUs. "
            "Waiting up to %.0f s for them (--worker-start-timeout-s).",
            free.get("CPU", 0), free.get("GPU", 0), need_cpus, need_gpus, config.worker_start_timeout_s,
        )


def _token_refused(address: str) -> UserError:
    given = "a token that it does not accept" if os.environ.get("RAY_AUTH_MODE") == "token" else "no token"
    return UserError(f"the Ray cluster at {address} requires token authentication and we sent {given}: set "
                     "RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                     "~/.ray/auth_token, as on the head)")


def _refused_authentication(error: BaseException | None) -> bool:
    """Whether a failed ray.init() was the cluster refusing our token (or the lack of one).

    Ray 2.60 raises ConnectionError("Failed to connect to Ray cluster at ...") from a
    RuntimeError("Failed to connect to GCS") whose *message* holds the traceback of the
    AuthenticationError (InvalidAuthToken): the type is lost on the way, its text is not.
    """
    import ray

    while error is not None:
        if isinstance(error, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _quiet_token_notice() -> None:
    # Ray 2.60 warns on every start or join that token authentication is on (its default): not for our console.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_ray(num_cpus: float, **init_kwargs) -> None:
    """ray.init(address="local"), with Ray's state API pointed at this Ray in this process and in all of its workers.

    Without an address, the state API (ray.util.state) asks the cluster that /tmp/ray/ray_current_cluster names:
    the last `ray start` on this machine, never a local ray.init. Ray Train V2's placement-group cleaner asks it
    whether the run's controller is alive, once a second. With that file stale (a `ray start` stopped since), each
    question waits on a dead address, and the run's end waits 12 s for the cleaner (measured: every run, "Failed to
    stop PlacementGroupCleaner gracefully"); with it naming another live cluster, the cleaner finds no controller
    there and would remove a running run's placement group. Ray's processes inherit this process's environment, so
    the address set before ray.init reaches the cleaner. A port chosen here for the dashboard (the state API's
    server) makes the address known before Ray starts.
    """
    import ray

    port = free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    init_kwargs.setdefault("logging_level", logging.WARNING)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, **init_kwargs)


def _start_local() -> None:
    # address="local": always a new local Ray, never a stale `ray start` cluster
    # found through /tmp/ray (joining is what RAY_ADDRESS is for).
    # One logical CPU beyond the workers' for Ray Data's tasks (streamed files):
    # without it, workers holding every CPU leave Ray Data waiting forever
    # (docs/design.md, "Ray Data needs a CPU beside the workers").
    # Ray Data reads parquet footers with 32 actors per read (each epoch of streamed files): 32 Python processes
    # to start on a laptop. One per core serves the few files a local run reads (the streamed-parquet test took
    # 157 s with 32 and 46 s with 1 on 2 cores). Set before ray.init so that Ray's daemons, and so every worker,
    # inherit it; a value the user set wins.
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", str(min(32, os.cpu_count() or 1)))
    # Ray starts its worker processes at nice 15 (the raylet's `worker_niceness`, read from the environment it starts
    # in), below its own daemons and this driver: the training workers of a run this process started are the run,
    # and train at its priority (`ray job submit` does the same for a job's workers). A value the user set wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_local_ray(num_cpus=(os.cpu_count() or 1) + 1)
    # Nothing preempts the nodes of a Ray this process started (Ray Train V2's watcher
    # is one more process, and its polls, on the critical path): read by fit().
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


_early: dict[str, object] = {}


def start_local_early(config: TrainConfig) -> None:
    """Start the local Ray on a thread, while this process checks the data and builds the model.

    Both take seconds of CPU (Ray's daemons start, TensorFlow imports): side by
    side they overlap on a machine with spare cores. Only the local Ray that
    connect() would start anyway, and only when the run fits this machine. A
    refusal from the checks still comes at once, and the process exits at once
    too: the thread is a daemon, Ray's exit handler stops what has started, and
    Ray's daemons end with this process (Linux fate-sharing; measured: exit
    1-4 s after a refusal, no Ray process left behind).
    """
    if joining_a_cluster() or "started" in _early:
        return
    check_fits_locally(config)
    _quiet_token_notice()

    def start() -> None:
        try:
            _start_local()
        except BaseException as e:  # re-raised by connect(), in the main thread
            _early["error"] = e
        finally:
            _early["started"].set()
        # Ray's daemons were forked by this thread with Linux's parent-death signal, which
        # fires when the forking *thread* ends: it lives as long as the process.
        threading.Event().wait()

    # Ray sets its SIGTERM handler (exit, so that its shutdown runs) only from the main
    # thread, and warns from any other: the same handler, set here, and no warning.
    if threading.current_thread() is threading.main_thread():
        import signal
        import sys

        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        logging.getLogger("ray._private.worker").addFilter(
            lambda record: not record.getMessage().startswith("SIGTERM handler is not set"))
    _early["started"] = threading.Event()
    threading.Thread(target=start, name="ray-start", daemon=True).start()


def _wait_for_early_start() -> None:
    if "started" not in _early:
        return
    _early["started"].wait()  # bounded by ray.init's own start-up timeouts
    error = _early.pop("error", None)
    if error is not None:
        raise error


# Ray Data's read and preprocessing tasks each take one CPU; with none free
# beside the workers, a streamed epoch waits forever (docs/design.md, "Ray Data needs a CPU beside the workers").
READ_CPUS = 1


def check_room_for_reads(config: TrainConfig, who: str = "the workers'") -> None:
    """Streamed data: refuse, before training (or predicting: ``who`` names the actors), a cluster whose CPUs the
    workers would fill completely."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    workers = config.max_workers * config.cpus_per_worker
    if total < workers + READ_CPUS:
        raise UserError(
            f"streamed data needs {READ_CPUS} CPU for Ray Data's reads beside {who} {workers:g}, but the "
            f"cluster has {total:g} CPUs ({workers + READ_CPUS - total:g} missing): lower --cpus-per-worker to "
            f"{max(total - READ_CPUS, 0.1) / config.max_workers:.2g} or --num-workers, add a node, or use "
            "in-memory data (.npz files, data functions returning arrays), which needs no Ray Data task"
        )


_NODE_ID_WIDTH = 64  # Ray node ids are 56 hex characters


def worker_nodes(collective, node_id: str) -> list[str]:
    """Every worker's Ray node id, in rank order, from an all-gather of the ids as fixed-width codes.

    Ray Train has no all-gather of Python objects (only a broadcast from rank
    0), and this runs once, so one small TensorFlow collective is the simplest.
    """
    import numpy as np

    code = np.frombuffer(node_id.encode().ljust(_NODE_ID_WIDTH)[:_NODE_ID_WIDTH], dtype=np.uint8)
    rows = collective.gather(code.astype(np.float64))
    return [bytes(row.astype(np.uint8)).decode().strip() for row in rows]
