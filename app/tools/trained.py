"""A trained model, located: a run's output directory, a .keras file, or a checkpoint of any backend; with the
config it was trained with (its data flags overridden by the ones given) and the task it was trained for.

What jobs/evaluate.py and jobs/predict.py (and app.evaluate / app.predict) are pointed at: ``--run DIR``,
``--model FILE`` (.keras), ``--checkpoint DIR``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from app import registry
from app.config import TrainConfig, build_config, read_yaml
from app.driver.outputs import CONFIG_FILE, MODEL_FILE, RESULT_FILE, STARTED_IN
from app.errors import UserError
from app.training import checkpoint
from app.training import model_file as keras_file


@dataclass(frozen=True)
class Trained:
    model_file: Path
    config: TrainConfig  # the run's, with the overrides given
    task: Optional[str]  # what the run recorded (result.json, a checkpoint's state); None when nothing says
    state_file: Optional[Path] = None  # a checkpoint's state (evaluate writes its metrics beside it)


def located(model: Any = None, checkpoint_dir: Any = None, run: Any = None,
            overrides: Optional[dict[str, Any]] = None, data_given: bool = False) -> Trained:
    """Exactly one of a .keras file, a checkpoint, a run's output directory. ``data_given``: the caller holds the
    rows (arrays from Python): the run's own data need not be loadable."""
    overrides = overrides or {}
    if checkpoint_dir:
        return from_checkpoint(checkpoint_dir, overrides, data_given)
    if run:
        run = Path(run)
        if not run.is_dir():
            raise UserError(f"no such run: {str(run)!r} is not a directory (give a run's output directory, "
                            "e.g. runs/train-<time>)")
        if not (run / MODEL_FILE).is_file():
            raise UserError(f"run {str(run)!r} has no {MODEL_FILE} (an unfinished run, or one trained with --export "
                            f"savedmodel): give --checkpoint {run} for its latest checkpoint")
        model = run / MODEL_FILE
    return from_model_file(model, overrides, data_given)


def from_model_file(model_file: Any, overrides: dict[str, Any], data_given: bool = False) -> Trained:
    """A .keras file: its run's config.yaml and result.json beside it (if any), then the overrides."""
    model_file = keras_file.check(model_file)
    result = model_file.parent / RESULT_FILE
    task = json.loads(result.read_text()).get("task") if result.is_file() else None
    return Trained(model_file, config_for(model_file, overrides, data_given), task)


def config_for(model_path: Path, overrides: dict[str, Any], data_given: bool = False) -> TrainConfig:
    """The run's config.yaml next to the model (if any), then the flags (dataset, val split, seed, ...)."""
    candidate = model_path.parent / CONFIG_FILE
    saved = _from_where_it_started(read_yaml(candidate), candidate) if candidate.is_file() else {}
    # The model comes from the file: the recorded builder is not needed, and one defined in a
    # script or a notebook ("__main__:build_model") could not be loaded here anyway.
    register_classes(saved.pop("model", None))
    return build_config(None, {**_data_of(saved, overrides, data_given, model_path), "output": str(model_path.parent),
                               **overrides})


def from_checkpoint(ckpt: Any, overrides: dict[str, Any], data_given: bool = False) -> Trained:
    """A checkpoint of any backend (app.training.checkpoint.located) carries its own config and task in its state."""
    found = checkpoint.located(ckpt)
    if found is None:
        raise UserError(f"{str(ckpt)!r} is not a checkpoint: give a Ray Train checkpoint directory (with "
                        f"{checkpoint.STATE_FILE}), a local or parameter-server run's {checkpoint.LOCAL_DIR}/ "
                        "directory (its latest checkpoint) or one of its checkpoints (.../epoch-N), or the run's "
                        "output directory")
    state_file, model_file = found
    by_keras_fit = list(state_file.parent.glob(f"{checkpoint.TRAIN_STATE}.*"))  # app.training.keras_worker's layout
    if not model_file.exists() and by_keras_fit:
        # The weights and every optimizer's state of a model Keras could not save (or a sharded or split one's),
        # which only that run's model function and data rebuild.
        raise UserError(f"{str(ckpt)!r} is a checkpoint of a run trained by Keras's fit: it holds the weights and the "
                        f"optimizers' state, not a {model_file.name}: evaluate the run's output (--run <its --output>), "
                        "or train on from it with --resume")
    keras_file.check(model_file)
    state = checkpoint.read_state(state_file)
    saved = {k: v for k, v in state.get("config", {}).items() if k != "model"}  # the model comes from the file
    register_classes(state.get("config", {}).get("model"))
    config = build_config(None, {**_data_of(saved, overrides, data_given, state_file.parent),
                                 "output": str(state_file.parent), **overrides})
    return Trained(model_file, config, state.get("task"), state_file)


def _from_where_it_started(saved: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """The run's relative paths (dataset, validation set, model file) that do not exist from here, made absolute
    from the directory the run was started in (config.yaml's "Started in" line) where they exist from there."""
    started = next((line[len(STARTED_IN):].strip() for line in config_file.read_text().splitlines()
                    if line.startswith(STARTED_IN)), None)
    if not started:
        return saved
    saved = dict(saved)
    for key in ("dataset", "val_dataset", "model"):
        value = saved.get(key)
        if not isinstance(value, str) or "://" in value:
            continue
        path, _, name = value.partition(":") if registry.is_plugin(value) else (value, "", "")
        if path and not Path(path).is_absolute() and not Path(path).exists() and (Path(started) / path).exists():
            saved[key] = str(Path(started) / path) + (f":{name}" if name else "")
    return saved


def _data_of(saved: dict[str, Any], overrides: dict[str, Any], data_given: bool, where: Path) -> dict[str, Any]:
    """The run's recorded config, its data as the caller replaces it: a --dataset given without --val-dataset
    replaces the run's validation file too (its rows are split as training split them). Data the run was handed
    from Python (arrays, a script's function) cannot be read again from config.yaml: the caller gives it, or one
    line says to."""
    saved = dict(saved)
    if "dataset" in overrides and "val_dataset" not in overrides:
        saved.pop("val_dataset", None)
    for name in ("dataset", "val_dataset"):
        value = saved.get(name)
        if name in overrides or not isinstance(value, str) or registry.is_dataset_name(value):
            continue
        if not data_given:
            raise UserError(f"{where} was trained on data passed from Python ({value}), which its config cannot read "
                            "again: give the data (app.evaluate(model, data=(x, y)), app.predict(run, data=x), or "
                            "--dataset PATH)")
        saved.pop(name)
    return saved


def register_classes(recorded: Any) -> None:
    """The run's model file or module imported (its function not called): the Keras classes it registers
    (``keras.saving.register_keras_serializable``) then load with the model. A built-in, a function passed from a
    script, or a file that is gone or fails to import: nothing here; the load says what it misses."""
    if not isinstance(recorded, str) or not registry.is_plugin(recorded) or not registry.reloadable(recorded):
        return
    with contextlib.suppress(UserError):  # the import's own error (UserCodeError) included
        registry.resolve(recorded, registry.MODELS)
