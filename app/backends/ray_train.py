"""The Ray backend: a Ray Train run of the one per-worker function, and the driver that launches it.

Driver:  config -> preflight (data, model, plan) -> Ray cluster (join or start) -> Ray Train fit() -> outputs
Worker:  app.backends.ray_session (MWMS, shards or object-store arrays, ray.train.report) -> train_worker
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from app.backend import backend_of
from app.backends.ray_session import WorkerInputs, train_loop_per_worker
from app.config import TrainConfig
from app.driver import cluster, outputs, resume
from app.errors import RunFailed, UserError
from app.training import checkpoint
from app.training.strategy import ray_strategy_name, ray_strategy_reason
from app.training.worker import WorkerJob
from app.ui import console, failures

log = logging.getLogger(__name__)

def fit(config: TrainConfig, checked, callbacks: list | None = None, storage_path: str | None = None,
        name: str | None = None, start_from: str | None = None) -> Any:
    """Run Ray Train with the TF_CONFIG backend (app.backends.tf_config) and return Ray's Result (raises RunFailed).

    ``checked`` is app.driver.preflight's result; ``callbacks`` run on the Train
    controller (Tune passes its TuneReportCallback); ``start_from``: a checkpoint of
    another backend that a resumed run goes on from (app.driver.resume).
    """
    import ray.train

    from app.backends import start_guard, tf_config
    from app.training.tensorboard import logdir_for

    # Both are propagated by Ray Train V2 from the driver to its controller.
    # Bound the wait for workers to be placed:
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(config.worker_start_timeout_s)
    # A worker's report() waits until the controller has taken the previous one,
    # and the controller looks every 2 s by default: that throttles short epochs
    # to one per 2 s. Polling every 0.5 s costs one small actor call per worker.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # A worker lost while the group starts must not leave its placement group holding the CPUs
    # that the restarted group waits for (app.backends.start_guard).
    start_guard.install()
    out = config.output_dir()
    source = checked.source
    inputs = WorkerInputs.of(source, checked.facts)
    datasets = {"train": source.train, "val": source.val} if source.streamed else None
    job = WorkerJob(checked.facts, checked.objective, logdir_for(config, name or out.name),
                    progress_bars=console.bars(), tensor=checked.model.get("tensor"))
    config = for_workers(config)
    trainer = tf_config.trainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={"config": config, "job": job, "inputs": inputs, "start_from": start_from},
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers,  # (MIN, MAX): Ray Train's elastic scaling resizes the group
            elastic_resize_monitor_interval_s=config.resize_check_s,
            use_gpu=config.use_gpu,
            # --tensor-parallel N on GPUs: each worker's shards on N GPUs of its own
            resources_per_worker={"CPU": config.cpus_per_worker,
                                  **({"GPU": config.tensor_degree} if config.use_gpu and config.tensor_degree else {})},
            placement_strategy=config.placement_strategy,
        ),
        datasets=datasets,
        dataset_config=_data_config(source, datasets) if datasets else None,
        run_config=_run_config(config, checked.objective, name or out.name,
                               storage_path or config.storage_path or str(out / "ray"), callbacks),
    )
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:  # fit() raises when the failure budget is spent
        raise RunFailed(failures.one_line(e, config)) from None
    except (KeyboardInterrupt, SystemExit):
        raise RunFailed(failures.interrupted(out)) from None
    if result.error is not None:
        raise RunFailed(failures.one_line(result.error, config))
    if result.checkpoint is None:
        raise RunFailed("training ended without reporting a checkpoint")
    return result


def _run_config(config: TrainConfig, objective, name: str, storage_path: str, callbacks: list | None):
    import ray.train

    return ray.train.RunConfig(
        name=name,
        storage_path=storage_path,
        callbacks=callbacks,
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=config.keep_checkpoints,
            checkpoint_score_attribute=f"val_{objective.metric}",
            checkpoint_score_order=objective.mode,
        ),
        # Start failures (a worker lost while the group starts, placement timed out) are the
        # controller's, retried without limit by default: they get the same budget as the rest.
        failure_config=ray.train.FailureConfig(max_failures=config.restarts, controller_failure_limit=config.restarts),
        worker_runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}},
    )


def for_workers(config: TrainConfig) -> TrainConfig:
    """The config as shipped to the workers: the model function itself, by value; no data function.

    Workers get the data from the object store or Ray Data, never from the data
    function, so it (and arrays it closes over) is not shipped. A user's model
    function is resolved here and pickled by value: a worker may not be able to
    import its module (a file loaded by path, a test module, a notebook).
    """
    from app import registry

    update: dict[str, Any] = {"dataset": config.model_dump()["dataset"]}
    # The model function, and the callbacks (a function rank 0 calls, or the callbacks' classes), likewise.
    for name, builtins in (("model", registry.MODELS), ("callbacks", {})):
        value = getattr(config, name)
        if isinstance(value, list):
            for c in value:
                by_value(type(c))
        elif value is not None and value not in builtins:
            update[name] = registry.resolve(value, builtins)
            by_value(update[name])
    return config.model_copy(update=update)


def by_value(obj) -> None:
    """Pickle the module that defines ``obj`` by value: a worker may not be able to import it (a file loaded by
    path, a test module, a notebook). What ``obj`` carries is followed: a partial's function and arguments (a
    built-in's carries the run's config, and with it a data function passed from Python), a wrapper's model
    function (app.training.default_compile.CompiledWithDefaults), a config's functions."""
    import functools

    from ray import cloudpickle

    if isinstance(obj, functools.partial):  # a partial's own module is functools: its function's is the one
        for carried in (obj.func, *obj.args, *obj.keywords.values()):
            by_value(carried)
        return
    if hasattr(type(obj), "model_fields"):  # a config: the functions it names
        for name in type(obj).model_fields:
            if callable(value := getattr(obj, name)):
                by_value(value)
        return
    if callable(getattr(obj, "model_fn", None)):
        by_value(obj.model_fn)
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__" or module.__name__.startswith(("app.", "keras")) \
            or module.__name__.split(".")[0] in sys.stdlib_module_names:  # importable everywhere
        return
    cloudpickle.register_pickle_by_value(module)


def _data_config(source, datasets):
    from app.data.streamed import data_config

    return data_config(datasets, source.cached)


RUN_NAME_FILE = resume.RUN_NAME_FILE


def _ray_run_name(config: TrainConfig, out: Path, start: Optional[resume.Start] = None) -> str:
    """The Ray Train run name: new for a new run, the recorded one for --resume.

    Ray Train resumes whatever run has this name in the storage path. A fresh
    name per run keeps a new run (or --overwrite) from silently continuing an
    old one left in shared storage (--storage-path); --resume reads it back,
    unless the run goes on from a checkpoint another backend wrote after it
    (``start``): then a new Ray run starts from that checkpoint.
    """
    recorded = out / RUN_NAME_FILE
    if config.resume and recorded.is_file() and (start is None or start.ray_train):
        return recorded.read_text().strip()
    name = f"{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    recorded.write_text(name)
    return name


def check(config: TrainConfig, require_fit: bool = True, loc=None):
    """Preflight for a Ray run: streamed data needs Ray (its checks read the files), in-memory data does not.

    A data function is called in this process (app.driver.preflight.load_data), once. For a run, Ray is
    connected first (sized here), so that a ray.data.Dataset it builds uses that Ray and not one Ray
    Data starts itself; a --dry-run starts no Ray unless the function builds a Dataset. ``loc``: the
    listing of --dataset if the caller made it (app.data.files.located), made here else.
    """
    from app import registry
    from app.data import files
    from app.driver import preflight

    loc = loc or files.located(config)  # listed once for the whole run
    streamed_files = files.streams(loc, backend_of(config).on_ray)
    joining = cluster.joining_a_cluster()  # asked before a data function's Dataset may start a Ray
    step_exact = config.elastic or config.checkpoint_every_steps
    if streamed_files and step_exact:
        raise UserError(files.STEP_EXACT.format(what=f"--dataset {config.dataset}"))
    if config.elastic and config.checkpoint_every_steps and config.global_batch is None:
        # This step's global batch follows the size (Keras's fit keeps the one it is given at every size)
        raise UserError(f"--checkpoint-every-steps with --num-workers {config.num_workers} needs --global-batch: a "
                        "checkpoint inside an epoch is a step of one global batch, which otherwise changes with the size")

    if require_fit:
        cluster.check_fits_locally(config)
        # A run: the local Ray starts beside the checks (they import TensorFlow, build the model).
        cluster.start_local_early(config)
        if joining:  # a cluster that refuses us (its token) is said first, before the checks
            cluster.connect(config, reads_for="the workers'" if streamed_files else None)
    function = not isinstance(config.dataset, str) or registry.is_plugin(config.dataset)
    if streamed_files or (function and require_fit):
        cluster.connect_for_data(config, reads=bool(streamed_files))
    checked = preflight.check(config, config.max_workers, loc=loc, tensor_devices=_tensor_devices(config))
    if checked.source.streamed and step_exact:
        raise UserError(files.STEP_EXACT.format(what=f"the Ray Dataset {registry.describe(config.dataset)} returned"))
    # A data function's ray.data.Dataset. The local Ray a run starts has the read CPU by construction
    # (cluster.connect); a cluster may not.
    if checked.source.streamed and not streamed_files and (require_fit or joining):
        cluster.check_room_for_reads(config)
    return checked


def _tensor_devices(config: TrainConfig) -> list[str]:
    """--tensor-parallel N: the devices the driver plans and checks the split on: N of its own when it can have
    them, as each worker splits its layers over N devices of its own (app.training.strategy.ray_worker_strategy)."""
    if not config.tensor_degree:
        return []
    from app.training.strategy import StrategyUnavailable, tensor_devices

    try:
        return tensor_devices(config.tensor_degree)
    except StrategyUnavailable:
        # This process's TensorFlow started before the run (an app.fit from a script that used it) or has fewer
        # GPUs than a worker gets: each worker is a process of its own with its own devices. The layout is
        # checked on the names the workers' devices have; the bytes each holds are counted there.
        return [f"{'GPU' if config.use_gpu else 'CPU'}:{i}" for i in range(config.tensor_degree)]


def _worker_bytes(state: dict[str, Any]) -> dict[str, Any]:
    """--tensor-parallel: the split layers' bytes on each device, as the first worker found them on its own."""
    held = state.get("tensor_device_bytes")
    return {"devices": list(held), "device_bytes": held} if held else {}


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Validate, train, and write the outputs. Returns result.json's content."""
    started_at = started_at or time.time()
    # Everything that can be refused is checked before the output directory exists,
    # and before Ray is used too, except for file datasets: Ray Data reads them to check them.
    checked = check(config)
    from app.driver import preflight

    lines, out = preflight.begin(config, checked, config.min_workers, _strategy(config))
    start = checked.resumed
    name = _ray_run_name(config, out, start)
    with console.routed(out / console.LOG_FILE, config.show_logs, plan=lines):
        result = fit(config, checked, name=name, start_from=start.path if start and not start.ray_train else None)
    with result.checkpoint.as_directory() as ckpt_dir:
        state = checkpoint.load_state(ckpt_dir)
        workers = state["plan"]["workers"]  # at the end (an elastic run's size changes: workers_over_time)
        summary = outputs.write_outputs(
            config, state, Path(ckpt_dir) / checkpoint.MODEL_FILE, strategy=ray_strategy_name(workers),
            started_at=started_at,
            extra={"strategy_reason": ray_strategy_reason(workers),
                   **({"tensor_parallel": {**tensor.as_dict(), **_worker_bytes(state)}}
                      if (tensor := checked.model.get("tensor")) else {})},
        )
    return summary


def dry_run_lines(config: TrainConfig) -> list[str]:
    """--dry-run's plan (app.run.api.driver)."""
    from app.driver import preflight

    fits = cluster.fit_warnings(config)
    return preflight.plan_lines(config, check(config, require_fit=False), config.min_workers, 1,
                                _strategy(config)) + fits


def _strategy(config: TrainConfig) -> str:
    """The workers' strategy, named before they start (an elastic run: at its largest, and its range)."""
    name = ray_strategy_name(config.max_workers)
    return f"{name} ({config.min_workers} to {config.max_workers} workers)" if config.elastic else name
