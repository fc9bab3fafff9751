"""Parameter-server training on Ray actors: the driver that starts the TensorFlow cluster and restarts it.

Ray Train runs TensorFlow only as MultiWorkerMirroredStrategy (ray-project/ray#38972),
so this is built on Ray Core, as ray-project/ray#41089 suggests:

    driver: preflight -> placement group (workers + parameter servers) -> one free port per task
            -> ParameterServer and Worker actors (a tf.distribute.Server each) -> Chief actor -> outputs
    Chief:  app.training.worker.train_worker with a ParameterServerSession (ParameterServerStrategy +
            ClusterCoordinator, app.training.parameter_server)

Failures: a Worker actor that dies is restarted by Ray in its bundle with the
same arguments, so its server comes back at the same address, and the
coordinator re-runs the steps it lost on the other workers meanwhile: the run
goes on. A parameter server that dies takes variables with it: the whole
cluster is restarted from the last checkpoint, up to --max-failures times.
The Chief runs on the driver's node, so the checkpoints and outputs it writes
are where the driver reads them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from app.backend import backend_of
from app.backends import ray_prep
from app.config import TrainConfig
from app.driver import cluster, outputs
from app.errors import RunFailed, UserError
from app.training import checkpoint
from app.training.worker import WorkerJob, train_worker
from app.ui import console, failures, worker_lines

log = logging.getLogger(__name__)

CHECKPOINT_DIR = checkpoint.LOCAL_DIR
# The training arrays travel inside each worker's dataset function (a TensorFlow graph, 2 GiB at most).
MAX_SHIPPED_MIB = 512


def _address() -> str:
    """This node's address and a port free now, for a TensorFlow server this process will start (chosen as the
    workers' MWMS ports are: app.backends.tf_config)."""
    from app.backends.tf_config import worker_address

    return worker_address()


class _ClusterTask:
    """One TensorFlow task's gRPC server, started in ``__init__``.

    Ray restarts a dead actor by calling ``__init__`` again with the same
    arguments in the same bundle: the server comes back at the address the
    cluster spec names, and the coordinator reconnects to it. The server is
    kept referenced and never ``join()``ed (that would block the actor).
    """

    def __init__(self, cluster_spec: dict[str, list[str]], job_name: str, index: int, cpus: float):
        import tensorflow as tf

        from app.training.strategy import set_thread_counts

        set_thread_counts(cpus)
        self.server = tf.distribute.Server(
            tf.train.ClusterSpec(cluster_spec), job_name=job_name, task_index=index, protocol="grpc", start=True
        )

    def pid(self) -> int:
        return os.getpid()


class ParameterServer(_ClusterTask):
    """Holds its share of the variables and applies the gradients sent to them."""


class Worker(_ClusterTask):
    """Runs the train steps the chief schedules on it, on its slice of the data."""


class Chief:
    """The coordinator: builds the model under ParameterServerStrategy, schedules steps, evaluates, checkpoints.

    Started with ``max_concurrency=2``: ``alive_at`` answers while ``train`` runs.
    """

    def __init__(self):
        self.address = _address()
        self.last_alive = time.time()

    def get_address(self) -> str:
        return self.address

    def alive_at(self) -> float:
        return self.last_alive

    def train(self, config: TrainConfig, job: WorkerJob, spec: dict[str, list[str]], train, val,
              checkpoint_dir: str, restore: bool) -> dict[str, Any]:
        from app.training.parameter_server import ParameterServerSession

        worker_lines.mark_worker_console("app")

        def alive() -> None:
            self.last_alive = time.time()

        alive()
        session = ParameterServerSession(config, spec, train, val, checkpoint_dir, restore,
                                         console.worker_progress_bar, alive)
        train_worker(config, job, session)
        return session.result()


class Restartable(Exception):
    """The cluster lost a parameter server or the chief, or stopped moving: restart it from the last checkpoint."""


@dataclass
class _Cluster:
    """The actors of one attempt and their placement group."""

    group: Any
    spec: dict[str, list[str]]
    parameter_servers: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    chief: Any = None

    def train(self, *args, stall_timeout_s: float) -> dict[str, Any]:
        """The chief's result; Restartable if a parameter server or the chief is lost or nothing moves for
        ``stall_timeout_s`` (a frozen task blocks the chief in any wait), RunFailed for any other error."""
        import ray

        run = self.chief.train.remote(*args)
        try:
            while not ray.wait([run], timeout=min(5.0, stall_timeout_s / 4))[0]:
                quiet = time.time() - ray.get(self.chief.alive_at.remote(), timeout=30)
                if quiet > stall_timeout_s:
                    raise Restartable(f"no step, evaluation or checkpoint for {quiet:.0f} s (--stall-timeout-s): "
                                      "a worker or parameter server froze or became unreachable")
            return ray.get(run)
        except ray.exceptions.GetTimeoutError:
            raise Restartable("the chief stopped answering") from None
        except ray.exceptions.RayActorError:
            raise Restartable("the chief was lost") from None
        except ray.exceptions.RayTaskError as e:
            lost = self.lost_parameter_servers()
            if lost:
                raise Restartable(f"parameter server {', '.join(map(str, lost))} was lost") from None
            raise RunFailed(f"training failed: {failures.summarize(e)}{failures.trace_note(e)}") from None

    def lost_parameter_servers(self) -> list[int]:
        import ray

        lost = []
        for i, actor in enumerate(self.parameter_servers):
            try:
                ray.get(actor.pid.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(i)
        return lost

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.workers, *self.parameter_servers, self.chief]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)


def start_cluster(config: TrainConfig) -> _Cluster:
    """Place the workers and parameter servers, give each a port, and start their servers and the chief."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    worker = {"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {})}
    bundles = [worker] * config.num_workers + [{"CPU": config.cpus_per_ps}] * config.num_ps
    group = placement_group(bundles, strategy=config.placement_strategy)
    ready, _ = ray.wait([group.ready()], timeout=config.worker_start_timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RunFailed(
            f"the cluster could not place {config.num_workers} workers x {config.cpus_per_worker:g} CPUs and "
            f"{config.num_ps} parameter servers x {config.cpus_per_ps:g} CPUs within {config.worker_start_timeout_s:g} s "
            "(--worker-start-timeout-s): add nodes, or lower --num-workers, --num-ps or the CPUs per task"
        )

    def in_bundle(i: int) -> dict[str, Any]:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)}

    # The chief writes the checkpoints and outputs: on the driver's node, where the driver reads them.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    chief = ray.remote(Chief).options(num_cpus=0, max_concurrency=2, scheduling_strategy=here).remote()
    address = ray.remote(num_cpus=0)(_address)
    ports = ray.get([address.options(**in_bundle(i)).remote() for i in range(len(bundles))])
    spec = {"chief": [ray.get(chief.get_address.remote())], "worker": ports[: config.num_workers],
            "ps": ports[config.num_workers:]}
    env = {"env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}}
    started = _Cluster(group, spec, chief=chief)
    for i in range(config.num_ps):
        started.parameter_servers.append(
            ray.remote(ParameterServer).options(num_cpus=config.cpus_per_ps, max_restarts=0, runtime_env=env,
                                                **in_bundle(config.num_workers + i))
            .remote(spec, "ps", i, config.cpus_per_ps)
        )
    for i in range(config.num_workers):
        started.workers.append(
            ray.remote(Worker).options(num_cpus=config.cpus_per_worker, num_gpus=1 if config.use_gpu else 0,
                                       max_restarts=-1, runtime_env=env, **in_bundle(i))
            .remote(spec, "worker", i, config.cpus_per_worker)
        )
    # Servers up before the chief connects (its connection would otherwise retry blindly).
    try:
        ray.get([a.pid.remote() for a in [*started.parameter_servers, *started.workers]],
                timeout=config.worker_start_timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        started.stop()
        why = "did not start" if isinstance(e, ray.exceptions.GetTimeoutError) else "failed to start"
        raise RunFailed(f"the parameter servers and workers {why} within {config.worker_start_timeout_s:g} s "
                        f"(--worker-start-timeout-s): {str(e).splitlines()[0]}") from None
    return started


STREAMED = (
    "--strategy parameter-server trains on in-memory data (built-in datasets, .npz/.npy files, data functions "
    "returning arrays); {what} goes through Ray Data: use the default strategy, or a data function that returns "
    "(x, y) arrays"
)


def check(config: TrainConfig, require_fit: bool = True):
    """ray_prep's checks, and parquet/CSV/image files refused before Ray Data reads them."""
    from app.data import files

    loc = files.located(config)
    if files.streams(loc, backend_of(config).on_ray):
        raise UserError(STREAMED.format(what=f"--dataset {config.dataset}"))
    checked = ray_prep.check(config, require_fit, loc)
    check_data(checked)
    return checked


def check_data(checked) -> None:
    """Parameter-server workers take in-memory arrays, shipped inside their dataset function."""
    source = checked.source
    if source.streamed:  # a data function's ray.data.Dataset
        raise UserError(STREAMED.format(what="a ray.data.Dataset"))
    mib = sum(a.nbytes for part in (source.train.x, source.train.y)
              for a in (part.values() if isinstance(part, dict) else [part])) / 2**20
    if mib > MAX_SHIPPED_MIB:
        raise UserError(
            f"--strategy parameter-server ships the training arrays to every worker inside its dataset function, "
            f"and these take {mib:,.0f} MiB (at most {MAX_SHIPPED_MIB}): use the default strategy for data this large"
        )


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Validate, train on a parameter-server cluster of Ray actors, and write the outputs."""
    import ray

    from app.driver import preflight
    from app.training.tensorboard import logdir_for

    started_at = started_at or time.time()
    checked = check(config)
    lines, out = preflight.begin(config, checked, config.num_workers, strategy_line(config))
    job = WorkerJob(checked.facts, checked.objective, logdir_for(config, out.name), progress_bars=console.bars())
    train, val = ray.put(checked.source.train), ray.put(checked.source.val)
    shipped = ray_prep.for_workers(config)
    restore = config.resume
    with console.routed(out / console.LOG_FILE, config.show_logs, plan=lines):
        for attempt in range(config.max_failures + 1):
            tf_cluster = start_cluster(config)
            try:
                done = tf_cluster.train(shipped, job, tf_cluster.spec, train, val, str(out / CHECKPOINT_DIR), restore,
                                        stall_timeout_s=config.stall_timeout_s)
                break
            except Restartable as e:
                if attempt == config.max_failures:
                    spent = f"after {attempt} restart(s)" if attempt else "raise --max-failures to restart from the " \
                        "last checkpoint instead"
                    raise RunFailed(f"training failed: {e} ({spent})") from None
                log.warning("%s: restarting the cluster from the last checkpoint (restart %d of %d, --max-failures)",
                            e, attempt + 1, config.max_failures)
                restore = True
            except KeyboardInterrupt:
                raise RunFailed(f"interrupted: the run was stopped after its last checkpoint; continue it with "
                                f"python jobs/train.py --output {out} --resume") from None
            finally:
                tf_cluster.stop()
    latest = done["latest"]
    state = checkpoint.read_state(latest + checkpoint.STATE_SUFFIX)
    return outputs.write_outputs(
        config, state, latest + checkpoint.MODEL_SUFFIX, strategy="ParameterServerStrategy", started_at=started_at,
        extra={
            "strategy_reason": "requested: asynchronous updates on parameter servers (Ray actors)",
            "num_workers": config.num_workers,
            "num_ps": config.num_ps,
            "num_replicas": config.num_workers,
            "steps_per_epoch": done["optimizer_steps"] // max(state["epoch"], 1),
            "optimizer_steps": done["optimizer_steps"],
            "variable_placement": done["variable_placement"],
        },
    )


def dry_run_lines(config: TrainConfig) -> list[str]:
    """--dry-run's plan (app.run.api.driver)."""
    from app.driver import preflight

    fits = cluster.fit_warnings(config)
    return preflight.plan_lines(config, check(config, require_fit=False), config.num_workers, 1,
                                strategy_line(config)) + fits


def strategy_line(config: TrainConfig) -> str:
    return (f"ParameterServerStrategy (asynchronous: each update is one worker's batch; {config.num_ps} "
            f"parameter server(s) x {config.cpus_per_ps:g} CPU)")
