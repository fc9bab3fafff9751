"""Evaluate an exported model in a plain process: no Ray, no distribution."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app.backend import backend_of
from app.config import TrainConfig
from app.driver import output_guard
from app.errors import UserError
from app.tools import trained
from app.training import checkpoint, model_file

log = logging.getLogger(__name__)


def evaluate_model(model_path: str | Path, config: TrainConfig) -> dict[str, Any]:
    """Val loss and metric of a .keras model on the config's validation split, summed exactly as in training."""
    import tensorflow as tf

    from app.data import tf_input
    from app.driver import preflight
    from app.training.loop import evaluate
    from app.training.measures import Measures, settle
    from app.training.model import check_output, task_with_model
    from app.training.objective import objective_for
    from app.training.step import make_eval_step

    model = _load(model_file.check(model_path))
    source = _data(config, [getattr(t, "name", None) for t in (model.inputs or [])])
    facts = task_with_model(source.facts, model, config.task)
    objective = settle(objective_for(config, facts, model, check_output(model, facts, str(model_path))), model, facts,
                       preflight.examples(source))
    measures = Measures(objective, model)
    strategy = tf.distribute.get_strategy()  # the default, single-device strategy
    if source.streamed:  # read by Ray Data in this process (a Ray run's files)
        batches = tf_input.eval_batches_from_shard(source.val, config.per_replica_batch, source.facts)
    else:
        batches = tf_input.eval_batches_from_arrays(source.val, config.per_replica_batch)
    stats = evaluate(strategy, make_eval_step(strategy, model, measures),
                     strategy.distribute_datasets_from_function(lambda _: batches), measures)
    return {"val_loss": stats.loss, **{f"val_{k}": v for k, v in stats.metrics.items()}, "val_samples": stats.samples}


def _load(model_path: Path):
    """The saved model, with the loss and metrics it was compiled with where Keras can rebuild them (a
    user's own metric class that is not registered cannot be: then the run's defaults score it)."""
    try:
        return model_file.load(model_path, compile=True)
    except UserError as e:  # a compile() object Keras cannot deserialize here
        log.warning("%s: scored without its compile() settings (%s); load_model(compile=False)", model_path, e)
        return model_file.load(model_path, compile=False)


def _data(config: TrainConfig, input_names: list):
    """The validation data: in memory without Ray (a data function is called here, and files are read here
    when the run's backend is local); files that stream on a local Ray that this process starts, or the
    cluster RAY_ADDRESS names (so is a function's ray.data.Dataset: app.driver.preflight.load_data)."""
    from app.data import files
    from app.driver import named_inputs, preflight

    loc = files.located(config)
    # The trained model's inputs, read by their names where the files have those columns (as its training read them)
    config = named_inputs.by_name(config, loc, input_names if all(input_names) else None)
    if files.streams(loc, backend_of(config).on_ray):
        from app.driver import cluster

        cluster.connect(config.model_copy(update={"num_workers": 1}))
    return preflight.load_data(config, 1, loc)


def evaluate_and_write(model_path: str | Path, config: TrainConfig, out_file: str | Path) -> dict[str, Any]:
    """The metrics, written to ``out_file`` beside the model; refused at once when another job is writing there
    (a run being trained or replaced: its model may change under the evaluation)."""
    output_guard.check_not_being_written(Path(out_file).parent)
    metrics = evaluate_model(model_path, config)
    metrics["model"] = str(model_path)
    metrics["dataset"] = config.model_dump(mode="json")["dataset"]  # a function as "module:name"
    Path(out_file).write_text(json.dumps(metrics, indent=2))
    return metrics


def evaluate_checkpoint(ckpt: str | Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """A checkpoint of any backend (app.tools.trained.from_checkpoint) carries its own config in its state.

    The metrics go to eval.json in a Ray Train checkpoint's directory, or to ``epoch-N.eval.json``
    beside a local or parameter-server checkpoint.
    """
    found = trained.from_checkpoint(ckpt, overrides)
    state_file = found.state_file
    if state_file.name == checkpoint.STATE_FILE:
        out_file = state_file.parent / "eval.json"
    else:
        out_file = state_file.with_name(state_file.name.removesuffix(checkpoint.STATE_SUFFIX) + ".eval.json")
    return evaluate_and_write(found.model_file, found.config, out_file), out_file
