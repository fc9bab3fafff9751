"""The plan of a run by Keras's fit (app.run.keras_step): what the run will do, a line per decision, said before
any worker starts (and all a --dry-run does)."""

from __future__ import annotations

from typing import Any, Optional

from app.data import keras_inputs
from app.models import scaled
from app.run import fit_inputs
from app.run.fit_inputs import overrides_step
from app.training import model as product_model
from app.training import sync_batch_norm


def lines(config, model, train, val, world: int, features, shard, tensor, compiled_line: Optional[str],
          class_weight: Any, validation_freq: Any, callbacks: Optional[list], x: Any, validation_data: Any,
          epochs: int, local: Any = None, stages: Any = None) -> list[str]:
    """Every line of the plan, in order (``compiled_line``: what the product compiled a model with, if it did;
    ``local``: the LocalReplicas the run trains under; ``stages``: a pipeline's StagePlan)."""
    from app.backend import backend_of

    on_ray = backend_of(config).on_ray
    compiled = [compiled_line] if compiled_line else []
    if unused := product_model.unused_options_line(config):
        compiled.append(unused)
    if config.class_names:  # a label column of class names, each mapped to its id (app.data.class_names)
        compiled.append(f"labels: class names, ids {', '.join(f'{n}={i}' for i, n in enumerate(config.class_names[:10]))}"
                        f"{', ...' if len(config.class_names) > 10 else ''} (config.yaml records them; predictions "
                        "name the class)")
    if isinstance(class_weight, dict):  # as Keras's fit takes it: each row's loss weighed by its class's
        compiled.append("class_weight: " + ", ".join(f"{c}: {w:.3g}" for c, w in sorted(class_weight.items()))
                        + " (each row's loss weighed by its class's, as in Keras's fit)")
    resizes = [_elastic_line(config, train, features.batch_size)] if config.elastic and on_ray else []
    if config.checkpoint_every_steps:
        resizes.append(f"checkpoints: every epoch, and every {config.checkpoint_every_steps} steps inside one (a "
                       "restart or a resize goes on from that step: its weights, optimizers, data position and the "
                       "epoch's metrics so far)")
    if config.audit_sample_ids:
        resizes.append("audit: the ids of the training rows each worker's input hands to fit(), gathered over the "
                       "workers every epoch into audit_sample_ids.json (result.json's audit: per epoch, the ids "
                       "trained and the distinct ones)")
    return [_run_line(config, world, features.batch_size, train.steps, epochs, local, stages),
            *([_replicas_line(local.strategy)] if local is not None else []),
            *([stages.line()] if stages is not None else [])] \
        + plan_lines(model, train, val, world, validation_freq, callbacks, stages is not None) + compiled \
        + features.lines() + shard.lines + (tensor.lines(per_worker=on_ray) if tensor else []) + resizes + [
            line for data, name in ((x, "x"), (validation_data, "validation_data"))
            if (line := _py_dataset_line(data, name))]


def _elastic_line(config, train, batch: Optional[int]) -> str:
    """The plan's line for an elastic range: how a resize goes on, and each size's part of the global batch."""
    every = f"every {config.checkpoint_every_steps} steps" if config.checkpoint_every_steps else "every epoch"
    sizes = range(config.min_workers, config.max_workers + 1)
    # ``batch``: Keras's, a step's; the global batch is an update's rows (the steps accumulated), as in the run line
    k = config.grad_accum
    per = f" x {k} accumulated steps" if k > 1 else ""
    at = "; ".join(f"{n}: {f'{-(-batch // n)} per replica{per}' if batch else 'its part of each batch per replica'}"
                   f", global {batch * k if batch else 'as given'}, {train.steps_on(n, 0, config.seed)} steps"
                   for n in sizes)
    return (f"elastic: {config.min_workers} to {config.max_workers} workers, resized by Ray Train (a restart from the "
            f"latest checkpoint, {every}; looks for room every {config.resize_check_s:g} s; a lost node spends "
            f"restarts, {config.restarts} in all: --max-failures); the global batch {batch * k if batch else '(as x gives it)'} "
            f"stays at every size, cut over its workers, so the math does not change; at {at}")


def _run_line(config, world: int, batch: int, steps: Optional[int], epochs: int, local: Any = None,
              stages: Any = None) -> str:
    """The plan's first line, as the product's own step words it: where, how wide, the global batch, how long."""
    from app.training.strategy import ray_strategy_name

    # The product's global batch is the rows of an update (result.json's): Keras's batch x the steps accumulated.
    accumulated = f" x {config.grad_accum} accumulated steps" if config.grad_accum > 1 and batch else ""
    if local is not None:
        n = local.replicas
        wide = f"{local.name} ({local.reason}), {n} replicas in this process"
        part = f" (= {batch // n} per replica{accumulated})" if batch % n == 0 else ""
    elif stages is not None:
        wide, part = f"pipeline (one replica, {len(stages.stages)} stages, one per device), in this process", ""
    else:
        wide = f"{ray_strategy_name(world)}, {world} worker(s)"
        part = f" (= {batch // world} per worker{accumulated})" if world > 1 and batch % world == 0 else ""
    part = part or (f" (= {batch}{accumulated})" if accumulated else "")
    return (f"run: backend {config.backend}, {wide}, global batch {batch * config.grad_accum if batch else batch}"
            f"{part}, "
            + (f"{steps} steps per epoch, " if steps else "") + f"{epochs} epochs")


def _replicas_line(strategy) -> str:
    """The plan's line for a local strategy of several replicas (app.run.config_run makes it)."""
    return (f"replicas: {', '.join(strategy.extended.worker_devices)}: model.fit cuts each global batch over them; "
            "each optimizer sums rows x gradient over the replicas (the strategy's all-reduce) and divides by the "
            "global batch's rows before it applies them, so clipping and the fp16 overflow check see the global "
            "batch's gradient; the metrics' states are summed over them")


def _py_dataset_line(data: Any, name: str) -> str:
    """What the plan says of a PyDataset's own parallel reading, which the product does not use."""
    if not keras_inputs.is_py_dataset(data):
        return ""
    workers, processes = getattr(data, "workers", 1), getattr(data, "use_multiprocessing", False)
    if workers <= 1 and not processes:
        return ""
    return (f"{name}: a PyDataset, read once here in the calling process, one batch after another: its workers="
            f"{workers}, use_multiprocessing={processes} are not used (each worker trains on its part of the rows "
            "read here)")


def plan_lines(model, train, val, world: int, validation_freq: Any, callbacks: Optional[list],
               pipeline: bool = False) -> list[str]:
    own = overrides_step(model)
    step = (f"the model's own {', '.join(own)}" if own else "the pipeline's train_step (each batch's micro-batches "
            "through the stages, then back, one update by the compiled optimizer) and Keras's test_step over the "
            "stages, for the compiled loss and metrics" if pipeline else "Keras's train_step and test_step for the "
            "compiled loss and metrics")
    dropped = train.dropped_rows(world)
    lines = [
        f"step: {step}, run by model.fit " + ("in this process" if pipeline else f"on each of {world} worker(s)")
        + (", gradients averaged over every global batch by one all-reduce per optimizer step" if world > 1 else ""),
        *([f"model: {model.name}, {model.count_params():,} parameters{scaled(model)}"]
          if model.built else []),
        *sync_batch_norm.plan_lines(model, world, getattr(train, "batch_size", None) and train.batch_size // world),
        (f"data: {train.num_rows} rows{fit_inputs.example_shapes(train)}, {train.steps} steps per epoch"
         if train.num_rows is not None else
         "data: rows and steps counted as the workers read the files (the driver read the first batch only)")
        + (f", each global batch split over {world} workers" if world > 1 else "")
        + (f"; {dropped} rows per epoch are in batches smaller than the workers and are not trained on" if dropped
           else ", every row once per epoch"),
        *[f"{what}: a tf.data pipeline that reads files ({fit_inputs.file_names(data.pipeline.files)}): every worker reads them "
          "itself every epoch, so they must be where every worker sees them (shared storage, gs:// or s3://); each "
          "worker parses every record and trains on its part of every batch" for data, what in
          ((train, "x"), (val, "validation_data")) if getattr(data, "pipeline", None) and data.pipeline.files],
        *(["x: a tf.data pipeline, run anew every epoch by every worker (each trains on its part of every batch): "
            "its shuffle reshuffles and its random maps draw again, as in Keras's fit"] if train.pipeline else
          [f"x: a tf.data pipeline read once here, as its first pass: {train.read_once}; its shuffle and random maps "
           "are not drawn again each epoch"] if train.read_once else []),
        *[data.describe(what) for data, what in ((train, "x"), (val, "validation_data"))
          if getattr(data, "streamed", False)],
        (f"validation: {val.num_rows if val.num_rows is not None else 'every'} rows"
         + (f", every {validation_freq} epochs" if validation_freq != 1 else "")
         if val is not None else "validation: none (no validation_data or validation_split): every row trains; "
         "epochs are ranked by the training loss"),
    ]
    if train.uneven_batches(world):
        lines.append(f"a global batch that does not divide over the {world} workers is cut into parts one row apart: "
                     "the gradients and Keras's loss are exact; a Mean tracker fed one value per batch (a train_step's "
                     "own, Keras's per-output losses) averages the parts' means (exact when every batch divides)")
    if callbacks:
        lines.append(f"callbacks: {', '.join(type(c).__name__ for c in callbacks)} on rank 0; their stop and "
                     "learning-rate decisions taken by every worker")
    executions = int(getattr(model, "steps_per_execution", 1) or 1)
    if train.steps_per_epoch and train.steps_per_epoch % executions:
        # Keras's fit reads such an input through one iterator and runs whole executions: it would go on into the
        # next epoch's batches. Each epoch here is the steps_per_epoch batches it names.
        whole = -(-train.steps_per_epoch // executions) * executions
        lines.append(f"warning: steps_per_epoch {train.steps_per_epoch} is not a multiple of the model's "
                     f"steps_per_execution {executions}: Keras's fit would run {whole} steps an epoch (whole "
                     f"executions), this run runs {train.steps_per_epoch}; give steps_per_epoch={whole} for the two to "
                     "agree")
    return lines
