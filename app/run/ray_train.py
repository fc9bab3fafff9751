"""Ray Train wiring: the per-worker function and the driver that launches it.

Driver:  config -> Ray cluster (join or start) -> Ray Datasets -> Ray Train fit() (app.tf_backend)
Worker:  MWMS -> model + optimizer under scope -> dataset shards -> loop -> report
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from app import checkpoint, data, monitor, sources
from app.config import TrainConfig
from app.errors import RunFailed, UserError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- #
# Worker                                                                      #
# --------------------------------------------------------------------------- #


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    """Runs in every Ray Train worker. Reads top to bottom: shards, strategy, model, input, loop, report."""
    import ray.train
    from ray.train import Checkpoint

    from app import strategy as strategy_lib

    config = TrainConfig(**payload["config"])
    # The shards first: asking for them starts Ray Data's split coordinators (new
    # processes) while this one imports TensorFlow, instead of after it (~3 s).
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    # MWMS must exist before any other TensorFlow op in this process.
    strategy = strategy_lib.multi_worker_strategy(config.cpus_per_worker)

    from app import models, monitor, scaling
    from app.loop import Loop, progress_line

    _log_to_stderr("app")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    feature_shape, num_classes = tuple(payload["feature_shape"]), payload["num_classes"]

    plan = data.EpochPlan(
        payload["num_train_rows"], world, config.per_replica_batch, strategy.num_replicas_in_sync // world,
        config.grad_accum,
    )
    lr_plan = scaling.plan_lr(config, plan.global_batch, plan.steps)

    with strategy.scope():
        model = models.build_model(config, feature_shape, num_classes)
        optimizer = scaling.make_optimizer(config, lr_plan)

    # A restarted worker group (a worker died) or a resumed run starts from the
    # last registered checkpoint: weights, optimizer (hence the LR schedule
    # position), epoch counter and history.
    progress = checkpoint.Progress()
    # Where every rank runs (a collective, once): result.json records it.
    progress.worker_nodes = _worker_nodes(strategy, ray.get_runtime_context().get_node_id(), world)
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            progress = checkpoint.Progress.resumed_from(checkpoint.restore(d, model, optimizer), progress)
        if rank == 0:
            log.info("resumed from the checkpoint of epoch %d (attempt %d)", progress.epoch, progress.attempt)

    train_iter = iter(
        strategy.distribute_datasets_from_function(
            lambda _: data.train_batches_from_shard(
                train_shard, plan, feature_shape, config.epochs - progress.epoch,
                shuffle_buffer=payload.get("shuffle_buffer", 0), seed=config.seed,
            )
        )
    )
    val_dataset = strategy.distribute_datasets_from_function(
        lambda _: data.eval_batches_from_shard(val_shard, config.per_replica_batch, feature_shape)
    )
    loop = Loop.for_run(strategy, model, optimizer, plan.global_batch, config)
    tensorboard = monitor.TensorBoard(payload["tensorboard_dir"] if rank == 0 else None)

    for epoch in range(progress.epoch + 1, config.epochs + 1):
        metrics, train = loop.run_epoch(epoch, train_iter, plan.steps, val_dataset, plan.dropped, tensorboard.step)
        metrics["worker_peak_rss_mib"] = _largest_peak_rss(loop, rank, world)
        progress.record(metrics, train.sample_ids)
        tensorboard.epoch(epoch, metrics)
        if rank == 0:
            log.info(progress_line(metrics, config.epochs, progress.history))

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            # Only rank 0 writes: replicas hold identical weights after every step.
            if rank == 0:
                state = progress.state(config=config, lr_plan=lr_plan, plan=plan)
                checkpoint.save(tmp, model, optimizer, state)
                ckpt = Checkpoint.from_directory(tmp)
            # Every worker reports (it is a barrier); Train V2 keeps only reports with a checkpoint.
            ray.train.report(metrics, checkpoint=ckpt)
    tensorboard.close()


def _worker_nodes(strategy, node_id: str, world: int) -> list[str]:
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


_NODE_ID_WIDTH = 64  # Ray node ids are 56 hex characters


def _largest_peak_rss(loop, rank: int, world: int) -> float:
    """The largest peak RSS (MiB) of any worker so far: what bounds a worker's memory (one tiny all-reduce)."""
    import numpy as np

    from app.report import peak_rss_mib

    mine = np.zeros(world)
    mine[rank] = peak_rss_mib()
    return float(loop.cross_worker_sum(mine).max())


def _log_to_stderr(name: str) -> None:
    """Show this package's INFO lines (Ray forwards worker stderr to the driver) without Ray's own."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


# --------------------------------------------------------------------------- #
# Driver                                                                      #
# --------------------------------------------------------------------------- #


def _joining_a_cluster() -> bool:
    import ray

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


def check_fits_locally(config: TrainConfig) -> None:
    """Refuse, before anything starts, a run that the local Ray we would start cannot hold."""
    if _joining_a_cluster():
        return  # a real cluster may autoscale: connect() says we are waiting instead
    cpus = os.cpu_count() or 1
    need_cpus = config.num_workers * config.cpus_per_worker
    if need_cpus > cpus:
        raise UserError(
            f"{config.num_workers} workers x {config.cpus_per_worker:g} CPUs need {need_cpus:g} CPUs, but this "
            f"machine has {cpus}: lower --num-workers or --cpus-per-worker, or set RAY_ADDRESS to use a cluster"
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
    if os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(logging_level=logging.WARNING)
        except ray.exceptions.AuthenticationError:
            raise UserError(
                f"the Ray cluster at {os.environ['RAY_ADDRESS']} refused our authentication token: set "
                "RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            ) from None
        free = ray.available_resources()
        need_cpus = config.num_workers * config.cpus_per_worker
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
    # One logical CPU beyond the workers' for Ray Data's shuffle/read tasks: without
    # it, workers holding every CPU leave Ray Data waiting forever (DESIGN.md).
    # The dashboard stays on: Train V2's placement-group cleaner uses its state API.
    ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 1, logging_level=logging.WARNING)


def build_datasets(config: TrainConfig, source: data.Source | sources.Streamed) -> dict[str, Any]:
    if isinstance(source, sources.Streamed):  # already Ray Datasets: shuffled, val padded (app.sources)
        return {"train": source.train, "val": source.val}
    train = data.to_ray_dataset(source.train)
    if config.shuffle:
        train = data.shuffled_each_epoch(train, config.seed)
    # Padding to a multiple of the worker count gives every worker the same
    # number of eval batches; the pad rows have weight 0.
    val = data.to_ray_dataset(source.val, pad_to_multiple_of=config.num_workers, weights=True)
    return {"train": train, "val": val}


def fit(
    config: TrainConfig,
    source: data.Source | sources.Streamed,
    callbacks: list | None = None,
    storage_path: str | None = None,
    name: str | None = None,
) -> Any:
    """Run Ray Train with the TF_CONFIG backend (app.tf_backend) and return Ray's Result (raises RunFailed).

    ``callbacks`` run on the Train controller (Tune passes its TuneReportCallback).
    """
    import ray.train

    from app import tf_backend

    # Both are propagated by Ray Train V2 from the driver to its controller.
    # Bound the wait for workers to be placed:
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(config.worker_start_timeout_s)
    # A worker's report() waits until the controller has taken the previous one,
    # and the controller looks every 2 s by default: that throttles short epochs
    # to one per 2 s. Polling every 0.5 s costs one small actor call per worker.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    out = config.output_dir()
    datasets = build_datasets(config, source)
    trainer = tf_backend.trainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={
            "config": config.model_dump(mode="json"),
            "feature_shape": list(source.feature_shape),
            "num_classes": source.num_classes,
            "num_train_rows": source.num_train_rows,
            "tensorboard_dir": monitor.logdir_for(config, name or out.name),
            "shuffle_buffer": getattr(source, "shuffle_buffer", 0),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker={"CPU": config.cpus_per_worker},
            placement_strategy=config.placement_strategy,
        ),
        datasets=datasets,
        dataset_config=sources.data_config(datasets, source.cached) if isinstance(source, sources.Streamed) else None,
        run_config=ray.train.RunConfig(
            name=name or out.name,
            storage_path=storage_path or config.storage_path or str(out / "ray"),
            callbacks=callbacks,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.keep_checkpoints,
                checkpoint_score_attribute="val_accuracy",
                checkpoint_score_order="max",
            ),
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            worker_runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}},
        ),
    )
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:  # fit() raises when the failure budget is spent
        raise RunFailed(f"training failed: {_summarize(e)}") from None
    except (KeyboardInterrupt, SystemExit):
        # Ray Train's SIGINT handler aborts the controller and exits; say how to continue.
        raise RunFailed(
            f"interrupted: the run was stopped after its last checkpoint; continue it with "
            f"python jobs/train.py --output {out} --resume"
        ) from None
    if result.error is not None:
        raise RunFailed(f"training failed: {_summarize(result.error)}")
    if result.checkpoint is None:
        raise RunFailed("training ended without reporting a checkpoint")
    return result


def _summarize(error: BaseException) -> str:
    """The last exception line of each worker's error, deduplicated (Ray's message holds whole tracebacks)."""
    failures = getattr(error, "worker_failures", None) or {0: error}
    by_message: dict[str, list[int]] = {}
    for rank, exc in sorted(failures.items()):
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
        message = raised[-1] if raised else (lines[0] if lines else type(exc).__name__)
        message = _EXCEPTION_LINE.sub(lambda m: "" if m.group(1) == "NonFiniteLoss" else f"{m.group(1)}: ", message)
        by_message.setdefault(message, []).append(rank)
    return "; ".join(f"{msg} (rank {', '.join(map(str, ranks))})" for msg, ranks in by_message.items())


# "package.module.SomeError: message" -> group(1) = "SomeError"
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Z]\w*(?:Error|Exception|Loss|Exit|Interrupt)): ")


RUN_NAME_FILE = "ray_run_name"


def _ray_run_name(config: TrainConfig, out: Path) -> str:
    """The Ray Train run name: new for a new run, the recorded one for --resume.

    Ray Train resumes whatever run has this name in the storage path. A fresh
    name per run keeps a new run (or --overwrite) from silently continuing an
    old one left in shared storage (--storage-path); --resume reads it back.
    """
    recorded = out / RUN_NAME_FILE
    if config.resume:
        if not recorded.is_file():
            raise UserError(f"cannot resume {str(out)!r}: it records no Ray run ({RUN_NAME_FILE} is missing)")
        return recorded.read_text().strip()
    name = f"{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    recorded.write_text(name)
    return name


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Validate, train, and write the outputs. Returns result.json's content."""
    from app import report

    started_at = started_at or time.time()
    # Everything that can be refused is checked before the output directory exists,
    # and before Ray exists too, except for file datasets: Ray Data reads them to check them.
    if sources.is_streamed(config):
        check_fits_locally(config)
        connect(config)
        source = sources.prepare(config, config.num_workers)
    else:
        source = data.load_source(config)
    data.EpochPlan(source.num_train_rows, config.num_workers, config.per_replica_batch, 1, config.grad_accum).check()
    check_fits_locally(config)
    out = report.prepare_output_dir(config)
    name = _ray_run_name(config, out)

    connect(config)
    result = fit(config, source, name=name)
    with result.checkpoint.as_directory() as ckpt_dir:
        summary = report.write_outputs(
            config,
            ckpt_dir,
            strategy="MultiWorkerMirroredStrategy",
            started_at=started_at,
            extra={"strategy_reason": "Ray Train workers: one replica each, gradients all-reduced across workers"},
        )
    log.info("outputs in %s", out)
    return summary
