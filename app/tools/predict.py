"""Batch prediction with a trained model: jobs/predict.py and app.predict.

On Ray (the default) the rows are a Ray Dataset (files read block by block by Ray Data, as training reads them),
``map_batches`` runs them through a pool of ``--num-workers`` actors (``ray.data.ActorPoolStrategy``), each holding
the model (app.training.predictor: the training path's features, the model, the output columns), and this
process writes the predicted blocks to ``--output`` in the input's order as they come (not Ray's
``write_parquet``: its tasks write on whichever node they run, and pyarrow's threaded writer inside each task
reorders the blocks it is given). Nothing waits for the whole dataset: memory
stays flat as the data grows (the same bounded read-ahead as training: app.data.streamed.streaming), and Ray
Data's progress bar shows the rows going through. ``--backend local``: the same predictor in this process, a
bounded batch at a time, written with pyarrow; Ray is not imported.

Every refusal is one line before the pool starts: no such run, model or checkpoint; an output that exists; a
dataset or column that is not there; examples whose shape does not fit the model (read from the first rows).
Rows keep their input order. ``_predict.json`` (what was predicted, with what, how many rows) is written last:
its presence says the output is complete (readers of the directory skip names starting with ``_``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.backend import BACKENDS, backend_of
from app.driver import output_guard
from app.errors import RunFailed, UserError
from app.tools.trained import Trained

log = logging.getLogger(__name__)

SUMMARY_FILE = "_predict.json"
LOG_FILE = "_predict.log"  # Ray's and TensorFlow's own lines (the actors' too)
# Rows per parquet file written (at least): a few MB of predictions, not one file per batch.
ROWS_PER_FILE = 100_000


@dataclass(frozen=True)
class PredictOptions:
    output: str  # the directory of parquet files written
    keep_columns: tuple[str, ...] = ()  # input columns written beside the predictions (an id)
    backend: str = "ray"  # ray: Ray Data and an actor pool; local: this process, no Ray
    num_workers: int = 2  # actors, each holding the model
    cpus_per_worker: float = 1.0  # each actor's CPUs, and its TensorFlow threads
    use_gpu: bool = False  # one GPU per actor
    batch_size: int = 256  # rows per model call
    overwrite: bool = False  # replace an existing --output

    def __post_init__(self) -> None:
        for name in ("num_workers", "cpus_per_worker", "batch_size"):
            if not 0 < getattr(self, name) < math.inf:  # nan and inf CPUs reserve nothing Ray can place
                raise UserError(f"--{name.replace('_', '-')} must be a number > 0 (got {getattr(self, name)})")
        if self.backend not in BACKENDS:
            raise UserError(f"--backend must be {' or '.join(BACKENDS)} (got {self.backend!r})")
        if not self.output:
            raise UserError("--output is required: the directory the predictions are written to")


def predict(found: Trained, options: PredictOptions, given: Any = None) -> dict[str, Any]:
    """Predict with ``found`` on its config's dataset (or ``given``: arrays, a DataFrame, a ray.data.Dataset);
    returns what ``_predict.json`` holds."""
    from app.ui import console

    # Libraries' lines (Ray Data's plans, the actors' TensorFlow notices) go to _predict.log, not the console.
    with console.for_people(found.config.show_logs):
        return _predict(found, options, given)


def _predict(found: Trained, options: PredictOptions, given: Any) -> dict[str, Any]:
    from app.data import inference

    started = time.time()
    keep = tuple(dict.fromkeys(options.keep_columns))
    config = found.config.model_copy(update={"backend": options.backend, "num_workers": options.num_workers,
                                             "cpus_per_worker": options.cpus_per_worker, "use_gpu": options.use_gpu})
    out = Path(options.output).expanduser().resolve()
    model = _load(found.model_file)
    if len(getattr(model, "outputs", None) or [None]) > 1:
        raise UserError(f"{found.model_file} has {len(model.outputs)} outputs ({', '.join(model.output_names)}), and "
                        "a prediction writes one per row: call model.predict on the loaded model, or score it with "
                        "jobs/evaluate.py")
    output_guard.check(out, "predict", _reads(found, config, given), overwrite=options.overwrite)
    if clash := set(keep) & {"prediction", "probabilities"}:
        raise UserError(f"--keep-columns {', '.join(sorted(clash))}: the predictions take that name; keep other columns")
    rows = inference.rows_of(config, given)
    task, from_logits = _task(found, config, model)
    on_ray = backend_of(config).on_ray
    if on_ray:
        from app.driver import cluster

        cluster.check_fits_locally(config)
        # Files are read by Ray Data's tasks, beside the actors: a full cluster would wait forever.
        cluster.connect(config, reads_for=None if rows.in_memory else "the predicting actors'")
    first = inference.first_rows(rows, config, keep)
    spec = inference.spec_for(rows, config, first, keep, _input_shape(model))
    del model  # the predictors load their own
    from app.training.predictor import Recipe

    # An actor gives TensorFlow its CPUs' threads; this process (local) has TensorFlow initialised already.
    recipe = Recipe(spec, task, from_logits, keep, options.batch_size, config.cpus_per_worker if on_ray else 0,
                    tuple(config.class_names or ()) if task == "classification" else ())
    log.info("predicting with %s on %s: %s, examples of shape %s, %s", found.model_file, rows.what, task,
             spec.feature_shape, f"{options.num_workers} Ray actor(s)" if on_ray else "this process")
    output_guard.take(out, "predict", replace=options.overwrite)  # every check above passed
    try:
        return _written(rows, config, found, recipe, options, out, on_ray, task, started)
    finally:
        output_guard.release(out)


def _written(rows, config, found: Trained, recipe, options: PredictOptions, out: Path, on_ray: bool, task: str,
             started: float) -> dict[str, Any]:
    """The predictions written to ``out``, then _predict.json, which says they are complete."""
    from app.ui import console

    pool_started = time.time()
    with console.routed(out / LOG_FILE, found.config.show_logs):
        if on_ray:
            _on_ray(rows, config, found.model_file, recipe, options, out)
        else:
            _in_this_process(rows, config, found.model_file, recipe, out)
    pool_seconds = time.time() - pool_started
    summary = {"model": str(found.model_file), "dataset": rows.what, "task": task, "output": str(out),
               "rows": _rows_written(out), "columns": _columns(out), "seconds": round(time.time() - started, 3),
               # from the pool's start (its actors' start and model load included) to the last file written
               "predict_seconds": round(pool_seconds, 3),
               "options": asdict(options)}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def _reads(found: Trained, config, given: Any) -> dict[str, Path]:
    """What the prediction reads from disk: the model (its run's directory holds its config), the checkpoint, the
    data (unless given from Python)."""
    reads = {"model": found.model_file, "checkpoint": found.state_file}
    if given is None:
        reads["--dataset"] = config.dataset
    return output_guard.reads_of(reads)


def _load(model_file: Path):
    from app.training import model_file as keras_file

    return keras_file.load(model_file, compile=False)


def _input_shape(model) -> Any:
    """One example's shape as the model takes it (None: a subclassed model that does not say); for a model of
    several inputs, {input name: shape} (fed from a dict of arrays by name: app.data.inference)."""
    inputs = getattr(model, "inputs", None)
    known = lambda shape: tuple(shape) if all(isinstance(d, int) for d in shape) else None  # noqa: E731
    if inputs and len(inputs) > 1:
        return {i.name: known(i.shape[1:]) for i in inputs}
    return known(inputs[0].shape[1:] if inputs else model.get_build_config()["input_shape"][1:])


def _task(found: Trained, config, model) -> tuple[str, bool]:
    """The task the run recorded (else --task, else the model's output: one value is a regression, unless a
    sigmoid makes it binary), and whether the model outputs logits (--from-logits, else its last activation)."""
    from app.training.model import ends_in_probabilities, task_without_labels

    task = found.task or (config.task if config.task != "auto" else None)
    if task is None:
        task = task_without_labels(model)
        log.info("no task recorded with %s: %s, from its output", found.model_file, task)
    # As the run decided it (app.training.objective): --from-logits, else the model's last activation.
    from_logits = config.from_logits if config.from_logits is not None else not ends_in_probabilities(model)
    return task, from_logits and task != "regression"


def _on_ray(rows, config, model_file: Path, recipe, options: PredictOptions, out: Path) -> None:
    import ray.data
    from ray.data import DataContext

    from app.data import inference
    from app.data.streamed import streaming
    from app.training.predictor import Predictor

    columns = [*recipe.spec.features, *recipe.keep]
    with streaming(config):  # small blocks, bounded read-ahead: memory flat as the data grows
        DataContext.get_current().execution_options.preserve_order = True  # rows out in the order they came in
        # A block goes to one actor, which calls the model on it a batch at a time. Files come in blocks of up to
        # 16 MiB (streaming); a repartition into blocks of one batch each, tried so that small data reaches every
        # actor, made 2 actors 5x slower than 1 on this 2-core machine (its tasks took the CPU the reads needed).
        ds = inference.ray_dataset(rows, config, columns, block_rows=16 * options.batch_size)
        ds = ds.map_batches(
            Predictor, fn_constructor_args=(model_file.read_bytes(), recipe), batch_size=options.batch_size,
            batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=options.num_workers),
            num_cpus=options.cpus_per_worker, num_gpus=1 if options.use_gpu else 0, udf_modifying_row_count=False,
        )
    try:
        _write(ds.iter_batches(batch_size=None, batch_format="pyarrow"), out)
    except ray.exceptions.RayError as e:
        from app.ui.failures import summarize, trace_note

        raise RunFailed(f"prediction failed: {summarize(e).removesuffix(' (rank 0)')}{trace_note(e)}") from None


def _in_this_process(rows, config, model_file: Path, recipe, out: Path) -> None:
    from app.data import inference
    from app.training.predictor import Predictor

    predictor = Predictor(model_file, recipe)
    _write((predictor(batch) for batch in inference.local_batches(rows, config, recipe.spec, recipe.keep)), out)


def _write(tables, out: Path) -> None:
    """Tables in the order they come, into ``part-NNNNN.parquet`` files of about ``ROWS_PER_FILE`` rows each."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    writer, rows, part = None, 0, 0
    try:
        for table in tables:
            if writer is not None and rows >= ROWS_PER_FILE:
                writer.close()
                writer, rows, part = None, 0, part + 1
            writer = writer or pq.ParquetWriter(out / f"part-{part:05d}.parquet", table.schema)
            table = table if table.schema.equals(writer.schema) else table.cast(writer.schema)
            writer.write_table(table)
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()


def _rows_written(out: Path) -> int:
    import pyarrow.dataset as pads

    return pads.dataset(str(out), format="parquet").count_rows()  # from the files' metadata


def _columns(out: Path) -> list[str]:
    import pyarrow.dataset as pads

    return pads.dataset(str(out), format="parquet").schema.names

