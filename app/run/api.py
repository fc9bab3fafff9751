"""The entry points the job scripts and the Python API share: train, dry-run, tune, evaluate, predict.

    from app import train
    result = train(model=build_model, data=load_data, num_workers=2, epochs=10)
    result["metrics"]["val_accuracy"]

``model`` and ``data`` take what ``--model`` and ``--dataset`` take (names,
``file.py:function``, paths) or the functions themselves, defined anywhere,
a notebook's ``__main__`` included: Ray ships them to the workers by value.
``data`` may also be (x, y) arrays or a {"train": (x, y), "val": (x, y)} dict.
Every other keyword is a config field (``python jobs/train.py --help``).
The result is what result.json holds.
"""

from __future__ import annotations

from typing import Any, Optional

from app.config import TrainConfig, build_config


def run_training(config: TrainConfig, started_at: Optional[float] = None) -> dict[str, Any]:
    from app.ui import console

    # The whole run, its checks included: libraries' lines stay off the console (app.ui.console).
    with console.for_people(config.show_logs):
        from app.driver import outputs

        outputs.check_output_dir(config)  # a path check: refused before the data, the model and Ray
        from app.run import config_run

        try:
            by_keras_fit = config_run.from_config(config)  # a model function of no arguments: Keras's fit
            return by_keras_fit if by_keras_fit is not None else driver(config).run(config, started_at)
        finally:
            outputs.release_output_dir(config)  # this process is done with it (a notebook goes on)


def driver(config: TrainConfig):
    """The module that runs the product's own loop (parameter servers; app.run.config_run hands every other run to
    Keras's fit): its ``run(config, started_at)`` trains, its ``dry_run_lines(config)`` is the plan. Imported
    here, not with this module: the Python API stays light."""
    from app.backends import ps

    return ps


def dry_run(config: TrainConfig) -> list[str]:
    """Validate, inspect the data, build the model once, and return the plan; trains nothing, writes nothing."""
    from app.ui import console

    with console.for_people(config.show_logs):
        return _dry_run(config)


def _dry_run(config: TrainConfig) -> list[str]:
    from app.driver import outputs

    outputs.check_output_dir(config)  # refused as the run would refuse it
    from app.run import config_run

    plan = config_run.from_config(config, dry=True)  # a model function of no arguments: Keras's fit's plan
    return [*(plan if plan is not None else driver(config).dry_run_lines(config)),
            f"output: {config.output_dir()} (not created: --dry-run)"]


def result_line(result: dict[str, Any]) -> str:
    """The run's last line: the metric that ranks it, the loss, the speed and the wall time (every run's result.json
    has them, whichever way it trained)."""
    m, metric = result["metrics"], result["metric"]
    loss = metric.split("_", 1)[0] + "_loss"
    speed = f"{result['samples_per_second']:,.0f} samples/s  " if result.get("samples_per_second") else ""
    return "  ".join(f"{k} {m[k]:.4f}" for k in dict.fromkeys((metric, loss)) if k in m) \
        + f"  {speed}{result['wall_seconds']:.1f} s wall"


def _plugins(model: Any, data: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if model is not None:
        values["model"] = model
    if data is not None:
        if isinstance(data, (tuple, dict)):
            arrays = data  # the arrays themselves: wrapped in a data function of no arguments

            def given_arrays():
                return arrays

            values["dataset"] = given_arrays
        else:
            values["dataset"] = data
    return values


def train(model: Any = None, data: Any = None, config: Optional[str] = None, callbacks: Any = None,
          **fields: Any) -> dict[str, Any]:
    """Train as jobs/train.py does and return result.json's content (see the module docstring).

    ``callbacks``: a list of keras.callbacks.Callback (or what --callbacks takes), run as model.fit runs them
    (app.training.callbacks: on rank 0; their stop and LR decisions apply to every worker).
    """
    return run_training(build_config(config, {**fields, **_plugins(model, data), "callbacks": callbacks}))


def tune(space: str, model: Any = None, data: Any = None, output: Optional[str] = None, **fields: Any) -> dict:
    """Sweep as jobs/tune.py does; returns the sweep's summary."""
    import datetime

    from app.tools import tune as tune_lib

    output = output or f"runs/tune-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    options = {k: fields.pop(k) for k in ("num_samples", "scheduler", "metric", "mode", "max_concurrent")
               if k in fields}
    from app.run.trial import run_trial

    return tune_lib.sweep(space, {**fields, **_plugins(model, data)}, output, **options, trial=run_trial)


def evaluate(model_file: str, data: Any = None, **fields: Any) -> dict[str, Any]:
    """Score an exported .keras model as jobs/evaluate.py does, by Keras's ``evaluate``. ``data``: arrays ``(x, y)``
    are scored whole, every row (``model.evaluate(x, y)``); a path or a data function, its validation split, cut as
    training cut it; none, the run's own validation rows."""
    from pathlib import Path

    from app.tools import evaluate as evaluate_lib
    from app.tools.trained import config_for

    model_file = Path(model_file)
    rows = data if isinstance(data, (tuple, list)) else None
    config = config_for(model_file, {**fields, **_plugins(None, None if rows is not None else data)},
                        data_given=rows is not None)
    return evaluate_lib.evaluate_and_write(model_file, config, model_file.parent / "eval.json", rows)


def predict(trained: str, data: Any = None, output: Optional[str] = None, keep_columns: Any = (),
            **fields: Any) -> dict[str, Any]:
    """Predict as jobs/predict.py does; returns what ``<output>/_predict.json`` holds.

    ``trained``: a run's output directory, a .keras file or a checkpoint (a local run's ``checkpoint/epoch-N``, a
    Ray Train ``checkpoint_...``). ``data``: what ``--dataset`` takes, or arrays (x alone, or (x, y)), a
    DataFrame, a ray.data.Dataset. The prediction's own options (``backend``, ``num_workers``,
    ``cpus_per_worker``, ``use_gpu``, ``batch_size``, ``overwrite``) and data fields (``feature_columns``, ...)
    as keywords; ``output`` defaults to ``runs/predict-<time>``.
    """
    import dataclasses
    import datetime
    from pathlib import Path

    from app.tools import predict as predict_lib
    from app.tools import trained as trained_lib

    own = {f.name for f in dataclasses.fields(predict_lib.PredictOptions)}
    options = {k: fields.pop(k) for k in list(fields) if k in own}
    output = output or f"runs/predict-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    keep = (keep_columns,) if isinstance(keep_columns, str) else tuple(keep_columns)
    overrides = {**fields, **({"dataset": data} if isinstance(data, str) or callable(data) else {})}
    path = Path(trained)
    given = None if isinstance(data, str) or callable(data) else data
    kind = "model" if path.suffix == ".keras" else "run" if (path / "model.keras").is_file() and (
        path / "config.yaml").is_file() else "checkpoint_dir"  # a run (a checkpoint has no config.yaml)
    found = trained_lib.located(**{kind: path}, overrides=overrides, data_given=given is not None)
    return predict_lib.predict(found, predict_lib.PredictOptions(output=output, keep_columns=keep, **options), given)
