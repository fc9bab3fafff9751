"""Everything checked before a run starts, and the plan a --dry-run prints.

Data first (schema, finite values, labels against the task and
--num-classes), then the model, built once for the data's shape in this
process (the user's function called, its output checked against the task,
its last activation read for the loss), then the epoch arithmetic. Each
problem is one UserError line; nothing here creates the output directory.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from app import config_scale
from app.backend import backend_of
from app.data.arrays import DataFacts, Source
from app.data.plan import EpochPlan
from app.errors import UserError
from app.models import scaled, weighted

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.data.files import Located
    from app.data.streamed import Streamed
    from app.training.objective import Objective

log = logging.getLogger(__name__)


@dataclass
class Checked:
    source: Union[Source, "Streamed"]
    facts: DataFacts
    objective: "Objective"
    model: dict[str, Any]  # name, parameters, output shape
    resumed: Any = None  # --resume: the checkpoint the run goes on from (app.driver.resume.Start), or None


def load_data(config: "TrainConfig", num_workers: int, loc: Optional["Located"] = None) -> Union[Source, "Streamed"]:
    """In-memory data (built-in, numpy, data functions; parquet, CSV and images on the local backend) or, for
    file formats that stream (on the Ray backend), Ray Datasets.

    ``loc``: the run's listing of --dataset (app.data.files.located), if it has one already.
    """
    from app import registry
    from app.data import files, memory
    from app.driver import named_inputs

    loc = loc or files.located(config)
    config = named_inputs.by_name(config, loc)  # a model whose inputs are named after the files' columns
    if files.streams(loc, backend_of(config).on_ray):
        from app.data import streamed

        return streamed.prepare(config, num_workers, loc)
    if loc is not None and loc.format != "numpy":  # --backend local: read in this process
        from app.data import local_files

        return local_files.load(config, loc)
    if isinstance(config.dataset, str) and registry.looks_like_path(config.dataset):
        return memory.load_source(config)
    # A data function, called here, once: arrays, a DataFrame (no Ray), or a ray.data.Dataset (streamed like parquet).
    value = memory.call_data_function(config)
    name = config.dataset if isinstance(config.dataset, str) else registry.describe(config.dataset)
    if memory.is_ray_dataset(value):
        from app.data import streamed

        if not backend_of(config).on_ray:
            raise UserError(f"{name} returned a ray.data.Dataset, which streams through Ray Data: train on it with "
                            "--backend ray, or return (x, y) arrays")
        from app.driver import cluster

        cluster.connect(config.model_copy(update={"num_workers": num_workers}))  # the Ray it runs on (if not up)
        return streamed.prepare(config, num_workers, files.given_dataset(name, value))
    return memory.load_source(config, value)


def check_model(config: "TrainConfig", facts: DataFacts, examples: Any = None) -> tuple[DataFacts, "Objective",
                                                                                       dict[str, Any]]:
    """Build the model once for the data's shape; its task (auto -> binary for one output), objective, summary."""
    from app.training.measures import settle
    from app.training.model import build_model, check_output, model_name, task_with_model
    from app.training.objective import objective_for

    name = model_name(config)
    model = build_model(config, facts)
    facts = task_with_model(facts, model, config.task)
    shape = check_output(model, facts, name)
    objective = settle(objective_for(config, facts, model, shape), model, facts, examples)
    summary = {"name": name, "parameters": int(model.count_params()), "scaled": scaled(model),
               "output_shape": {k: list(v) for k, v in shape.items()} if isinstance(shape, dict) else list(shape),
               "outputs": "values" if facts.task == "regression" else
               ("logits" if objective.from_logits else "probabilities"),
               # what a --resume's checkpoint must hold (app.driver.resume), in the optimizer's order
               "weights": [(v.path, tuple(v.shape)) for v in model.trainable_variables]}
    return facts, objective, summary


def examples(source) -> Any:
    """A few training rows (x, y) to check the loss and metrics on, where the driver holds them."""
    import numpy as np

    if source.streamed:
        return None
    rows = source.train.rows(np.arange(min(128, len(source.train))))
    return rows.x, rows.y


def check(config: "TrainConfig", num_workers: int, replicas_per_worker: int = 1,
          source: Union[Source, "Streamed", None] = None, loc: Optional["Located"] = None) -> Checked:
    """Data, model and epoch plan, checked; the streamed path needs Ray connected first."""
    source = source if source is not None else load_data(config, num_workers, loc)
    facts, objective, summary = check_model(config, source.facts, examples(source))
    if config.callbacks is not None:  # called here once, as each worker's model function is
        from app.training.callbacks import check as check_callbacks

        summary["callbacks"] = check_callbacks(config, objective)
    plan = checked_plan(config, facts.num_train_rows, num_workers, replicas_per_worker)
    checked = Checked(source, facts, objective, summary)
    if config.resume:
        from app.driver import resume

        checked.resumed = resume.check(config, summary["weights"], plan.global_batch)
    return checked


def checked_plan(config: "TrainConfig", rows: int, num_workers: int, replicas_per_worker: int = 1) -> EpochPlan:
    """The epoch plan at ``num_workers``, refused in one line when its batch does not fit the training rows (at
    every size of an elastic run)."""
    sizes = list(config_scale.sizes(config.num_workers)) if config.elastic else [num_workers]
    for n in sizes:
        plan = EpochPlan.for_run(config, rows, n, replicas_per_worker)
        if not plan.steps and config.global_batch is not None:  # the fix is a smaller --global-batch
            raise UserError(global_batch_too_large(config, rows, [n * replicas_per_worker for n in sizes]))
        plan.check()
    return EpochPlan.for_run(config, rows, num_workers, replicas_per_worker)


def global_batch_too_large(config: "TrainConfig", rows: int, replicas: Sequence[int]) -> str:
    """--global-batch above the training rows, and the largest batch that fits them and splits over every count of
    ``replicas`` the run may have."""
    step = math.lcm(*(n * config.grad_accum for n in replicas))
    fits = rows // step * step
    fix = f"use --global-batch {fits}" if fits else "give more training rows, or fewer workers"
    return f"--global-batch {config.global_batch} is larger than the {rows} training rows: {fix}"


def lr_line(lr, objective, config: "TrainConfig") -> str:
    """The plan's learning-rate line: as compiled (what model.fit would do), or the product's scaled schedule."""
    if lr.as_compiled:
        what = f"{lr.base_lr:g}" if lr.base_lr is not None else f"the compiled {objective.compiled_optimizer}'s schedule"
        return (f"learning rate: {what} as compiled (no scaling, no warmup, no decay: as model.fit; "
                "--lr-scaling, --warmup-epochs, --lr-decay or --base-lr ask for them)")
    return (f"learning rate: {lr.peak_lr:.4g} after scaling ({lr.rule} rule: base {lr.base_lr:g} "
            f"({dict(objective.sources).get('learning rate', '--base-lr')}) at batch "
            f"{lr.reference_batch}), {lr.warmup_steps} warmup steps, then {lr.decay}")


def batches_line(plan: EpochPlan) -> str:
    """What the plan does with the rows that whole batches leave over."""
    if not plan.dropped:
        return "every training row once per epoch (whole batches)"
    return (f"{plan.dropped} training rows dropped per epoch (whole batches on every replica: the product's own "
            "loop, which parameter servers train on, takes one batch size)")


def begin(config: "TrainConfig", checked: Checked, num_workers: int, strategy: str) -> tuple[list[str], Path]:
    """A Ray run's start once its checks passed: the plan logged, Ray joined (the local one started beside the
    checks), then the output directory made. Returns the plan's lines and the directory."""
    from app.driver import cluster, outputs
    from app.ui import console

    lines = plan_lines(config, checked, num_workers, 1, strategy)
    for line in lines:
        log.info(line)
    cluster.connect(config)
    out = outputs.prepare_output_dir(config)
    log.info("output: %s (Ray's and TensorFlow's own lines: %s)", out, out / console.LOG_FILE)
    return lines, out


def plan_lines(config: "TrainConfig", checked: Checked, num_workers: int, replicas_per_worker: int,
               strategy: str) -> list[str]:
    """The plan a --dry-run prints (and a real run logs at its start)."""
    from app.training.optim import plan_lr

    facts = checked.facts
    asynchronous = backend_of(config).parameter_servers
    objective = checked.objective
    plan = EpochPlan.for_run(config, facts.num_train_rows, num_workers, replicas_per_worker, asynchronous)
    lr = plan_lr(config, plan.update_batch, plan.updates, objective)
    run = (f"global batch {plan.global_batch} (= {plan.per_replica_batch} per replica"
           f"{f' x {config.grad_accum} accumulated' if config.grad_accum > 1 else ''}), {plan.steps} steps per epoch")
    if asynchronous:
        run = f"global batch {plan.update_batch} per update (one worker's batch), {plan.updates} updates per epoch"
    target = f"{facts.num_classes} classes" if facts.num_classes else "a float target"
    m = checked.model
    lines = [
        f"data: {facts.num_train_rows:,} training rows, {facts.num_val_rows:,} validation rows, examples of shape "
        f"{facts.example_shape}, {facts.task} ({target}); {batches_line(plan)}",
        f"model: {m['name']}, {m['parameters']:,} parameters, output shape {_shape(m['output_shape'])} "
        f"({m['outputs']}){m.get('scaled', '')}",
        objective_line(config, objective),
        f"run: backend {config.backend}, {strategy}, {num_workers} worker(s) x {replicas_per_worker} replica(s), "
        f"{run}, {config.epochs} epochs",
        own_loop_line(asynchronous),
        lr_line(lr, objective, config),
    ]
    from app.training.model import unused_options_line

    if unused := unused_options_line(config):
        lines.append(unused)
    if m.get("callbacks") is not None:
        lines.append(f"callbacks: {', '.join(m['callbacks']) or 'none'} (on rank 0; a stop or LR change applies to "
                     "every worker)")
    if config.resume:
        from app.driver import resume

        lines.append(resume.plan_line(config, checked.resumed, plan, lr))
    return lines


def own_loop_line(asynchronous: bool) -> str:
    """Why this run trains on the product's own loop and not, as every other run, on Keras's fit."""
    if asynchronous:
        return ("step: the product's own loop, not Keras's fit (Keras 3's fit has no ParameterServerStrategy): each "
                "worker's step applies the gradients of its own batch to the parameter servers' variables")
    return ("step: the product's own loop, not Keras's fit (Keras's fit has no step that runs one batch's micro-batches "
            "through stages on several devices): the gradients of the loss over the global batch, applied once a batch")


def objective_line(config: "TrainConfig", objective: "Objective") -> str:
    """What is optimised and reported, and where each setting came from (compile(), a flag, a default)."""
    where = dict(objective.sources)
    optimizer = objective.compiled_optimizer or config.optimizer
    metrics = ", ".join(objective.metric_names)
    weights = f"; class weights {config.class_weight}" if objective.class_weights else ""
    return (f"objective: optimizer {optimizer} ({where['optimizer']}), loss {objective.loss_name}"
            f"{weighted(objective.loss_weight)} "
            f"({where['loss']}), "
            f"metrics {metrics} ({where['metrics']}; the run's metric: val_{objective.metric}){weights}")


def _shape(shape) -> str:
    """(10,), or out_a (1,), out_b (3,) for a model with several outputs."""
    if isinstance(shape, dict):
        return ", ".join(f"{k} {tuple(v)}" for k, v in shape.items())
    return str(tuple(shape))
