"""Evaluate an exported model in a plain process: no Ray, no distribution."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app import internals
from app.backend import backend_of
from app.config import TrainConfig
from app.driver import output_guard
from app.errors import UserError
from app.tools import trained
from app.training import checkpoint, default_compile, model_file, user_code

log = logging.getLogger(__name__)


def evaluate_model(model_path: str | Path, config: TrainConfig, rows: Any = None) -> dict[str, Any]:
    """Val loss and metrics of a .keras model, by Keras's own ``evaluate``: the loss and metrics it was compiled
    with (or the run's defaults, for a model that compiles nothing), its own ``test_step`` if it has one, every row
    once: the values training reported for the same weights and rows. The rows: ``rows`` ((x, y) arrays, every one
    scored, as ``model.evaluate(x, y)``), else the config's validation split."""
    from app.training.model import check_output, task_with_model

    model = _load(model_file.check(model_path))
    if rows is not None:
        import tensorflow as tf

        x, y = rows[0], rows[1]
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(config.per_replica_batch)
        labels, count = y, len(tf.nest.flatten(y)[0])
    else:
        source = _data(config, [getattr(t, "name", None) for t in (getattr(model, "inputs", None) or [])])
        check_output(model, task_with_model(source.facts, model, config.task), str(model_path))
        batches = _val_batches(source, config.per_replica_batch)
        labels, count = None if source.streamed else source.val.y, source.facts.num_val_rows
    if not getattr(model, "compiled", False):
        _compile(model, config, batches, labels)
    elif config.loss:  # --loss (the run's, or this evaluation's): the loss its compile() is scored with
        default_compile.check_loss_name(config.loss)
        default_compile.Recompile(loss=config.loss, from_logits=bool(config.from_logits)).compile(model)
    _check_loss(model, batches)
    logs = internals.flat_logs(model.evaluate(batches, verbose=0, return_dict=True))
    return {**{f"val_{k}": v for k, v in logs.items()}, "val_samples": count}


def _val_batches(source, batch_size: int):
    """(x, y) batches of every validation row once: the rows of weight 0 that pad a streamed shard are left out."""
    from app.data import tf_input

    if not source.streamed:
        batches = tf_input.eval_batches_from_arrays(source.val, batch_size)  # one process: no padding
        return batches.map(lambda x, y, _w: (x, y))
    return (tf_input.eval_batches_from_shard(source.val, batch_size, source.facts).unbatch()
            .filter(lambda _x, _y, w: w > 0).map(lambda x, y, _w: (x, y)).batch(batch_size))


def _compile(model, config: TrainConfig, batches, labels) -> None:
    """A model saved without its compile(): its own ``test_step`` scores it, or else the run's defaults, decided
    from the labels (``labels``: every validation label in memory, or None: the first batch's) as training decided
    them (app.training.default_compile)."""
    if "test_step" in user_code.own_methods(model):
        model.compile()
        return
    first = next(iter(batches))
    default_compile.decide(model, first, first[1].numpy() if labels is None else labels, config).compile(model)


def _check_loss(model, batches) -> None:
    """The compiled loss on the first batch, before the evaluation's graph: labels it cannot take (a --loss for
    one-hot labels given class ids, another task's loss) are one line, not a graph error."""
    if {"test_step", "compute_loss"} & set(user_code.own_methods(model)):
        return  # its own step decides what it computes
    x, y = next(iter(batches))
    out = model(x, training=False)
    try:
        model.compute_loss(x, y, out, training=False)
    except Exception as e:  # any failure of the loss on these labels
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        shapes = (f" for labels of {y.dtype.name}, shape {tuple(y.shape[1:])} per row, and outputs of shape "
                  f"{tuple(out.shape[1:])} per row" if hasattr(y, "dtype") and hasattr(out, "shape") else "")
        raise UserError(f"the model's loss {default_compile.loss_name(model)} does not take these labels and its outputs "
                        f"({type(e).__name__}: {first}): give a --loss{shapes}, or the data it was trained on") from None


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


def evaluate_and_write(model_path: str | Path, config: TrainConfig, out_file: str | Path,
                       rows: Any = None) -> dict[str, Any]:
    """The metrics, written to ``out_file`` beside the model; refused at once when another job is writing there
    (a run being trained or replaced: its model may change under the evaluation)."""
    output_guard.check_not_being_written(Path(out_file).parent)
    metrics = evaluate_model(model_path, config, rows)
    metrics["model"] = str(model_path)
    recorded = config.model_dump(mode="json")  # a function as "module:name"
    # Where the scored rows came from: the arrays given, a validation file, or the dataset its split is cut from.
    metrics["dataset"] = "arrays given to app.evaluate" if rows is not None else \
        recorded["val_dataset"] or recorded["dataset"]
    Path(out_file).write_text(json.dumps(metrics, indent=2))
    output_guard.note_written(Path(out_file))  # the run's --overwrite may replace it
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
