"""The Keras-step run: each Ray worker (or the one local process) runs the model's own fit().

Driver:  fit()'s inputs read once (app.data.keras_inputs) -> Ray (join or start) -> Ray Train fit() of
         ``keras_loop_per_worker`` -> the final checkpoint restored into a model built here -> outputs
Worker:  app.training.keras_worker.keras_fit_worker, with a ``RayKerasSession`` (or ``LocalKerasSession``)

The outputs: history.csv and result.json (Keras's epoch logs as the History has them), the trained model as
``weights.weights.h5`` (any model Keras can train), and model.keras and a SavedModel where Keras can save them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from app import internals
from app.backends import run_checkpoints
from app.backends.keras_record import export, summary, trained_model
from app.config import TrainConfig
from app.data.keras_inputs import KerasData
from app.driver import cluster, outputs, time_report
from app.errors import NonFiniteLoss, RunFailed, UserCodeError
from app.training import keras_worker
from app.training.keras_worker import KerasJob
from app.ui import console, failures, worker_lines

log = logging.getLogger(__name__)


@dataclass
class KerasRun:
    """What the driver hands back: the epoch records, the trained model, result.json's content."""

    records: list[dict[str, Any]]
    model: Any
    result: dict[str, Any]


class RayKerasSession:
    """A Ray Train worker's side of ``keras_fit_worker``."""

    strategy = None  # one replica per worker: the workers' all-reduce is the product's (app.training.keras_sync)

    def __init__(self, payload: dict[str, Any]):
        import ray.train

        from app.backends import tf_config

        # The worker's start-up marks (app.training.step_clock): its function entered, its TF_CONFIG given.
        self.entered = time.time()
        self.configured = tf_config.SET_AT[0] if tf_config.SET_AT else None
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.payload, self._started = payload, False

    def start(self) -> None:
        from app.training.strategy import ray_worker_strategy

        if self._started:
            return
        self._started = True
        # MWMS only configures the collectives from TF_CONFIG (app.training.collective); nothing runs in its scope.
        ray_worker_strategy(self.payload["cpus_per_worker"], self.payload["stall_timeout_s"], self.world,
                            self.payload["tensor_degree"])

    def inputs(self) -> tuple[KerasData, Optional[KerasData]]:
        import ray
        import ray.train

        train, val = ray.get(self.payload["train"]), ray.get(self.payload["val"]) if self.payload["val"] else None
        for data in (train, val):
            if getattr(data, "streamed", False):  # a path or a ray.data.Dataset: this worker's split of it
                data.shard = ray.train.get_dataset_shard(data.name)
        return train, val

    def last_checkpoint(self) -> Optional[str]:
        import ray.train

        restored = ray.train.get_checkpoint()
        if restored is None:
            return self.payload["start_from"]  # a resumed run: its last checkpoint, until this Ray run has one
        import pyarrow.fs

        # Not Checkpoint.to_directory()'s default directory (one per checkpoint and node: a worker copies it again
        # over the files another is reading, "file is too short to be an sstable"). A local checkpoint is read where
        # it is; a remote one is copied into this worker's own temporary directory, left there as Ray leaves its copy.
        if isinstance(restored.filesystem, pyarrow.fs.LocalFileSystem):
            return restored.path
        return restored.to_directory(tempfile.mkdtemp(prefix=f"checkpoint-rank{self.rank}-"))

    def save_and_report(self, record: dict[str, Any], write: Callable[[str], None]) -> None:
        import ray.train
        from ray.train import Checkpoint

        from app.training.keras_callbacks import as_metrics

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if self.rank == 0:  # the workers hold the same weights after every step
                write(tmp)
                ckpt = Checkpoint.from_directory(tmp)
            # Every worker reports (it is a barrier); a sweep reads the logs under every run's names too. A
            # checkpoint inside an epoch (--checkpoint-every-steps) reports where it is, and no epoch's logs.
            ray.train.report(record if "step" in record else
                             {**record, **as_metrics(record), "epoch_seconds": record["seconds"]}, checkpoint=ckpt)

    def progress_bar(self, total: int, desc: str):
        from app.ui import console

        return console.worker_progress_bar(total, desc)

    def worker_nodes(self, collective) -> list[str]:
        import ray

        return cluster.worker_nodes(collective, ray.get_runtime_context().get_node_id())


def keras_loop_per_worker(payload: dict[str, Any]) -> None:
    from ray import cloudpickle

    worker_lines.mark_worker_console("app")
    session = RayKerasSession(payload)
    # The job (the model function, the callbacks) may hold TensorFlow objects, a layer adapted in the driver:
    # unpickled only once the collectives and threads are set, which must come before any TensorFlow op.
    session.start()
    with worker_lines.marked_stdout() if session.rank == 0 else contextlib.nullcontext():  # the user's prints: shown
        keras_worker.keras_fit_worker(cloudpickle.loads(payload["job"]), session)


class LocalKerasSession:
    """One process, no Ray: checkpoints in <output>/checkpoint; ``strategy``: a tf.distribute strategy of several
    local replicas (app.training.strategy.local_strategy), else None (TensorFlow's default: one device)."""

    rank, world = 0, 1

    def __init__(self, train: KerasData, val: Optional[KerasData], directory: Path, strategy: Any = None):
        self.train, self.val, self.directory, self.strategy = train, val, directory, strategy

    def start(self) -> None:
        """Nothing: TensorFlow runs in the caller's process as the caller set it up (as model.fit would)."""

    def inputs(self):
        return self.train, self.val

    def last_checkpoint(self) -> Optional[str]:
        found = run_checkpoints.whole(self.directory)
        return str(found) if found else None

    def progress_bar(self, total: int, desc: str):
        from app.backends.local import tqdm_bar

        return tqdm_bar(total, desc)

    def worker_nodes(self, collective) -> list[str]:
        return []

    def save_and_report(self, record: dict[str, Any], write: Callable[[str], None]) -> None:
        partial = self.directory.with_name(self.directory.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        write(str(partial))
        run_checkpoints.replace(self.directory, partial)


WARNING = "warning: "  # a plan line that starts so is a warning


@dataclass(frozen=True)
class RayRun:
    """Where a Ray Train run keeps its checkpoints and who watches it: a sweep's trial (app.run.trial) passes Tune's
    report callback, its trial directory and the name its checkpoints go under."""

    callbacks: tuple = ()
    storage_path: Optional[str] = None  # default: --storage-path, else <output>/ray
    name: Optional[str] = None  # default: <output's name>-<time>


def run(config: TrainConfig, job: KerasJob, plan: list[str], datasets: Optional[dict] = None,
        ray_run: RayRun = RayRun(), local: Any = None) -> KerasRun:
    """Train ``job`` on ``config``'s backend and write the outputs (the output directory is checked already).
    ``datasets``: the Ray Datasets of streamed inputs (app.data.keras_stream), by the name the workers ask for;
    ``local``: the LocalReplicas (app.training.strategy) the run trains under (None: one replica)."""
    from app.backend import backend_of

    started = time.time()
    time_report.mark("plan")
    for line in plan:  # a warning reaches the console even under app.fit(verbose=0)
        (log.warning if line.startswith(WARNING) else log.info)(line.removeprefix(WARNING))
    on_ray = backend_of(config).on_ray
    if on_ray:
        cluster.connect(config)
        time_report.mark("ray")
    out = outputs.prepare_output_dir(config, job.not_in_force)
    log.info("output: %s (%s own lines: %s)", out, "Ray's and TensorFlow's" if on_ray else "TensorFlow's",
             out / console.LOG_FILE)
    name = ray_run.name or f"{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"  # Ray Train's run (storage), TensorBoard's
    from app.training.tensorboard import logdir_for

    tensorboard = logdir_for(config, name)
    job = dataclasses.replace(job, tensorboard_dir=tensorboard, recorded=outputs.recorded_fields(config),
                              log_every_steps=config.log_every_steps,
                              profile_dir=f"{tensorboard or out / 'tensorboard'}/profile")
    try:
        with console.routed(out / console.LOG_FILE, config.show_logs, plan=plan):
            if on_ray:
                directory = _ray_fit(config, job, out, datasets or {}, dataclasses.replace(ray_run, name=name))
            else:
                names = internals.keep_keras_names()  # as this process's worker builds its model
                time_report.mark("fit")
                try:
                    keras_worker.keras_fit_worker(job, LocalKerasSession(job.train, job.val, out / "checkpoint",
                                                                         local and local.strategy))
                except NonFiniteLoss as e:
                    raise RunFailed(str(e)) from None
                except UserCodeError as e:  # as a Ray run's: the user's traceback in the run's log
                    raise UserCodeError(f"{e} (full traceback in {console.write_trace(str(e), e.trace)})") from None
                directory = str(out / "checkpoint")
            time_report.mark("fit returned")
        return _outputs(config, job, out, directory, started, local, None if on_ray else names)
    finally:
        outputs.release_output_dir(config)


def _ray_fit(config: TrainConfig, job: KerasJob, out: Path, datasets: dict, ray_run: RayRun) -> str:
    import ray
    import ray.train

    from app.backends import start_guard, tf_config

    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(config.worker_start_timeout_s)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    start_guard.install()
    from ray import cloudpickle

    from app.backends.ray_prep import by_value

    for obj in [job.model_fn, *(type(c) for c in job.callbacks or [])]:
        by_value(obj)
    payload = {"job": cloudpickle.dumps(KerasJob(**{**job.__dict__, "train": None, "val": None})),
               "train": ray.put(job.train), "val": ray.put(job.val) if job.val is not None else None,
               "cpus_per_worker": config.cpus_per_worker, "stall_timeout_s": job.stall_timeout_s,
               "start_from": run_checkpoints.last_checkpoint(config, out),
               # --tensor-parallel: the worker splits its CPU into that many devices before its TensorFlow starts
               "tensor_degree": len(job.tensor.devices) if job.tensor is not None else None}
    from app.data import keras_stream

    trainer = tf_config.trainer(
        train_loop_per_worker=keras_loop_per_worker,
        train_loop_config=payload,
        datasets=datasets or None,
        dataset_config=keras_stream.data_config(datasets) if datasets else None,
        scaling_config=ray.train.ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu,
                                               elastic_resize_monitor_interval_s=config.resize_check_s,
                                               resources_per_worker={"CPU": config.cpus_per_worker, **(
                                                   {"memory": int(config.memory_per_worker * 2**30)}
                                                   if config.memory_per_worker else {})},
                                               placement_strategy=config.placement_strategy),
        run_config=ray.train.RunConfig(
            name=ray_run.name, storage_path=ray_run.storage_path or config.storage_path or str(out / "ray"),
            callbacks=list(ray_run.callbacks) or None,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=config.restarts,
                                                   controller_failure_limit=config.restarts),
            worker_runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}},
        ),
    )
    time_report.mark("fit")
    try:
        with tf_config.in_drivers_directory():
            result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise RunFailed(failures.one_line(e, config)) from None
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train's SIGINT handler aborts the controller and exits
        raise RunFailed(failures.interrupted(out)) from None
    if result.error is not None:
        raise RunFailed(failures.one_line(result.error, config))
    if result.checkpoint is None:
        raise RunFailed("training ended without reporting a checkpoint")
    final = out / "checkpoint"
    # This run's own last checkpoint (a resumed run's) is replaced by the new one.
    run_checkpoints.replace(final, Path(result.checkpoint.to_directory(str(out / "checkpoint.partial"))))
    return str(final)


def _outputs(config: TrainConfig, job: KerasJob, out: Path, directory: str, started: float,
             local: Any = None, names: Optional[Callable[[], None]] = None) -> KerasRun:
    """``names``: Keras's name counters as this process's own worker built its model (None: a Ray run's)."""
    from app.backend import backend_of

    model, state = trained_model(job, directory, names)
    records = state["history"]
    # The workers of the last epoch (an elastic run's size changes; the record says it).
    world = (records[-1]["workers"] if records else config.min_workers) if backend_of(config).on_ray else 1
    exported = export(model, out, config.export)
    outputs.write_history(out / outputs.HISTORY_FILE, records)
    from app.training import keras_audit
    from app.training.keras_callbacks import as_metrics

    if records and all("loss" in r for r in records):  # a train_step that logs no loss (a GAN's d_loss) has no curve
        try:
            outputs.plot_curves([{"epoch": r["epoch"], **as_metrics(r)} for r in records], out / outputs.CURVES_FILE,
                                subtitle=f"{world} worker(s), global batch {job.features.batch_size}, by Keras's fit")
        except (TypeError, ValueError) as e:  # logs no plot takes (a metric of one value per class): the run stands
            log.warning("%s not drawn: %s", outputs.CURVES_FILE, e)
    result = {"config": {k: v for k, v in config.model_dump(mode="json").items() if k not in job.not_in_force},
              **({"compiled": job.compiled.as_dict()} if job.compiled is not None else {}),
              "history": records, "final": records[-1] if records else {},
              "workers": world, **summary(job, state, world, started, model, config.backend, local),
              "checkpoint": "checkpoint", "history_file": outputs.HISTORY_FILE, **exported,
              # per worker (rank 0's): every optimizer's variables, and a sharded one's flat part of the weights
              "optimizer_state_bytes": state.get("optimizer_state_bytes"),
              "optimizer_parts_bytes": state.get("optimizer_parts_bytes"),
              "seconds": round(time.time() - started, 2)}
    time_report.mark("outputs")
    result["time"] = time_report.report(state.get("time"), getattr(job.train, "streamed", False), world)
    log.info(result["time"]["line"])
    if job.profile_steps and "://" not in str(job.profile_dir) and not Path(str(job.profile_dir)).is_dir():
        log.warning("--profile-steps %d:%d: the run ended before step %d: nothing profiled", *job.profile_steps,
                    job.profile_steps[0])
    if keras_audit.STATE_KEY in state:  # --audit-sample-ids: every epoch's ids, and result.json's counts of them
        audited = state[keras_audit.STATE_KEY]
        (out / outputs.AUDIT_FILE).write_text(json.dumps(audited))
        result["audit"] = keras_audit.summary(audited)
    (out / outputs.RESULT_FILE).write_text(json.dumps(result, indent=1, default=str))
    return KerasRun(records, model, result)
