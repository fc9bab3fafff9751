"""app.fit: ``keras.Model.fit``'s arguments, on ``num_workers`` Ray workers (or ``backend="local"``: one process).

    history = app.fit(build_model, x, y, batch_size=256, epochs=10, validation_split=0.2, num_workers=2)
    history.history["val_accuracy"]   # one value per epoch, keyed as Keras's History
    history.model                     # the trained model

``model_fn`` builds the model (each worker builds its own): a function, a built-in name or a ``file.py:function``.
Every run trains by Keras's fit but parameter servers'; which way app.fit takes there is decided here once:

- **Keras's fit as given** (app.run.keras_step), for a model function of no arguments (a model compiled, overriding
  ``train_step`` / ``test_step`` / ``compute_loss`` / ``compute_metrics``, or compiling nothing: the product compiles
  it with the task's defaults, app.training.default_compile; a built-in name with arrays ``x`` and ``y`` too, sized
  by them: app.run.fit_inputs.builtin_for_arrays), with an ``x`` that Keras's fit reads itself (arrays, dicts or
  lists of them, a ``tf.data.Dataset``, a ``keras.utils.PyDataset``, a generator) or a path of files or a
  ``ray.data.Dataset``, streamed to the workers (app.data.keras_stream). Every argument means what it means in
  ``keras.Model.fit`` (``batch_size`` is the global batch; no validation argument validates nothing); every worker
  runs the model's own fit, made one exact run across workers by app.training.keras_sync. The product's features
  (``grad_accum``, ``mixed_precision``, the learning-rate rule, an elastic range, ``tensor_parallel``,
  ``shard_optimizer``, ``tensorboard``, ``export``, a pipeline: app.run.keras_step.KERAS_STEP_FIELDS) are Keras's
  own there (app.training.keras_features); a keyword it does not take (``per_replica_batch``, a built-in model's
  option) is one line saying what to give instead.
- **A run of one config** (app.run.api, as app.train): a built-in model on other inputs, a model function that
  takes the product's arguments, an ``x`` that is a data function (as ``--dataset``), or parameter servers asked
  for (the product's own loop, which trains the layers of a compiled model, not a model's own step).
  Here ``batch_size`` must divide over the replicas, ``validation_data`` is ``(x_val, y_val)`` arrays (or a path
  with a path ``x``), no validation argument holds out the seeded ``val_fraction`` (default 0.2: this path reports
  validation numbers every epoch), and ``initial_epoch``, ``steps_per_epoch``, ``validation_steps``,
  ``validation_batch_size`` and ``validation_freq`` are refused in one line that says what to use. ``callbacks``
  run as app.train runs them.

``verbose`` takes Keras's values: 0 prints nothing but warnings and errors (the epochs go to <output>/train.log),
2 one line per epoch, 1 and "auto" the same and a progress bar inside long epochs at a terminal. Every other
keyword is a config field, as app.train takes (``python jobs/train.py --help``); ``config=`` a YAML file of them.
Everything refusable is refused with one line before the data is checked or Ray starts.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Optional

import numpy as np

from app.backend import backend_of
from app.config import TrainConfig, build_config
from app.data import keras_stream
from app.data.keras_inputs import check_class_weight, is_array_input
from app.data.tf_datasets import is_tf_dataset
from app.errors import UserError
from app.run.history import History, read_records
from app.run.keras_step import DEFAULT_COMPILE_FIELDS, KERAS_BATCH_SIZE, KERAS_STEP_FIELDS, PIPELINE_FIELDS
from app.run.keras_step import given as _given


def keras_step_input(x: Any) -> bool:
    """An input that a model's own fit trains on: what Keras's fit reads itself (arrays, or a dict, list or tuple
    of them, a tf.data.Dataset, a keras.utils.PyDataset, a generator), and a path or a ray.data.Dataset, streamed
    to the workers (app.data.keras_stream); not a data function, the product's own input."""
    import inspect

    return (is_array_input(x) or is_tf_dataset(x) or inspect.isgenerator(x) or keras_stream.is_streamed(x)
            or any(c.__name__ == "PyDataset" for c in type(x).__mro__))


def fit(
    model_fn: Any,
    x: Any = None,
    y: Any = None,
    batch_size: Optional[int] = None,
    epochs: int = 1,
    validation_data: Any = None,
    validation_split: float = 0.0,
    callbacks: Optional[list] = None,
    num_workers: int = 2,
    sample_weight: Any = None,
    class_weight: Optional[dict] = None,
    verbose: Any = "auto",
    shuffle: bool = True,
    initial_epoch: int = 0,
    steps_per_epoch: Optional[int] = None,
    validation_steps: Optional[int] = None,
    validation_batch_size: Optional[int] = None,
    validation_freq: int = 1,
    **fields: Any,
) -> History:
    """Train as ``model.fit(x, y, ...)`` means it, on ``num_workers`` Ray workers (see the module docstring)."""
    from app.run.api import run_training

    check_class_weight(class_weight)
    if "model" in fields:
        raise UserError("model is app.fit's first argument: app.fit(build_model, x, y, ...)")
    if keras_step_input(x) and not _is_keras_model(model_fn):
        from app import registry
        from app.run import config_run, fit_inputs, keras_step

        if isinstance(model_fn, str) and model_fn in registry.MODELS and _is_array(x) and _is_array(y):
            model_fn = fit_inputs.builtin_for_arrays(model_fn, x, y, fields, validation_split)  # sized by the arrays
        local = config_run.local_replicas_of(fields)  # several local replicas: made before any model is built
        asked = config_run.backend_asked(fields)
        built = keras_step.keras_model_of(model_fn, fields.get("tensor_parallel"))
        product_only = _product_only(fields, x, built, local, asked)
        own_loop = bool(product_only) and asked is not None and asked.own_loop
        if built is not None and product_only and not own_loop:
            # one device or several (Keras's fit trains under their strategy); val_fraction: keras_step.fit says
            product_only = sorted(set(product_only) - {"strategy", "devices", "val_fraction"})
            if product_only:
                keras_step.refuse_for_fit({k: fields[k] for k in product_only}, model_fn)
        if built is not None and own_loop and keras_step.overrides_step(built):
            raise UserError(f"{', '.join(product_only)}: the product's own loop, which trains the model's layers, "
                            f"not its own {', '.join(keras_step.overrides_step(built))}: leave them out")
        if built is not None and not product_only:
            args = keras_step.FitArguments(
                x, y, batch_size=batch_size, epochs=epochs, validation_data=validation_data,
                validation_split=validation_split, callbacks=callbacks, num_workers=num_workers,
                sample_weight=sample_weight, class_weight=class_weight, verbose=verbose, shuffle=shuffle,
                initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                validation_batch_size=validation_batch_size, validation_freq=validation_freq)
            run, out = keras_step.fit(built, model_fn, args, fields, local=local)
            return History.of_keras_run(run.result, out, epochs, run.model, verbose)
    _keras_only(verbose, initial_epoch, steps_per_epoch, validation_steps, validation_batch_size, validation_freq)
    fields["shuffle"] = shuffle

    if _is_keras_model(model_fn):
        raise UserError("app.fit takes the function that builds the model, not a built model: every worker builds "
                        "its own under the strategy (app.fit(build_model, x, y, ...))")
    config_file = fields.pop("config", None)
    if class_weight is not None:  # Keras's {class: weight} -> --class-weight's JSON
        fields["class_weight"] = json.dumps({str(int(k)): float(v) for k, v in dict(class_weight).items()})
    values = {**fields, **_data_fields(x, y, validation_data, validation_split, fields, sample_weight),
              "model": model_fn, "epochs": epochs, "num_workers": num_workers, "callbacks": callbacks or None}
    config = _with_global_batch(config_file, values, batch_size)
    from app.ui import console

    quiet = {0: console.silent, 2: console.no_bars}.get(verbose, contextlib.nullcontext)
    with quiet():
        result = run_training(config)
    out = config.output_dir()
    if "final" in result:  # trained by Keras's fit (app.run.config_run): its records are Keras's epoch logs
        return History.of_keras_run(result, out, epochs, verbose=verbose)
    return History(result, read_records(out / result["history_file"]), out / result["model_file"], verbose)


def _product_only(fields: dict[str, Any], x: Any, built: Any, local: Any, asked: Any) -> list[str]:
    """The keywords given that only the product's own loop takes (none: Keras's fit trains the run)."""
    from app.run import keras_step

    # val_fraction: a path's or a Ray Dataset's seeded holdout; the optimizer's: a model compiling nothing's compile
    return sorted(set(fields) - KERAS_STEP_FIELDS - ({"val_fraction"} if keras_stream.is_streamed(x) else set())
                  - (DEFAULT_COMPILE_FIELDS if built is not None and not keras_step.brings_its_step(built) else set())
                  - ({"strategy", "devices"} if local is not None else set())
                  - (PIPELINE_FIELDS if asked is not None and asked.pipeline else set()))


def _keras_only(verbose: Any, initial_epoch: int, steps_per_epoch: Optional[int], validation_steps: Optional[int],
                validation_batch_size: Optional[int], validation_freq: int) -> None:
    """fit()'s arguments that this product takes as Keras means them, or refuses in one line naming what to use."""
    if verbose not in (0, 1, 2, "auto") or isinstance(verbose, bool):
        raise UserError(f"verbose must be 0, 1, 2 or 'auto', as in Keras's fit (got {verbose!r}): 0 prints "
                        "nothing, the others one line per epoch (Ray's and TensorFlow's own lines: <output>/train.log)")
    if initial_epoch:
        raise UserError("initial_epoch continues an earlier run in Keras: here, give that run's output and "
                        "resume=True (app.fit(..., output=<run>, resume=True, epochs=<total>))")
    if steps_per_epoch is not None or validation_steps is not None:
        raise UserError("steps_per_epoch and validation_steps cut epochs short in Keras: here every epoch visits each "
                        "training row once and validation scores every validation row; leave them out")
    if validation_batch_size is not None:
        raise UserError("validation_batch_size: validation runs at the training batch here (a batch size does not "
                        "change the validation numbers); leave it out")
    if validation_freq != 1:
        raise UserError(f"validation_freq={validation_freq!r}: every epoch is validated here (its record and "
                        "checkpoint need the numbers); leave it out")


def _data_fields(x: Any, y: Any, validation_data: Any, validation_split: float, fields: dict,
                 sample_weight: Any = None) -> dict[str, Any]:
    """x, y (and sample weights) and the validation arguments -> the config's dataset (and val_dataset)."""
    if "dataset" in fields:
        raise UserError("give the data as x (arrays, a data function or a path), not dataset=")
    if not 0 <= validation_split < 1:
        raise UserError(f"validation_split must be in [0, 1) (got {validation_split!r})")
    validating = validation_data is not None or validation_split > 0
    given = [k for k in ("val_fraction", "val_dataset") if k in fields]
    if validating and given:
        raise UserError(f"{given[0]} is the product's own validation set, used without validation_data and "
                        "validation_split: pass one or the other")
    if x is None:
        raise UserError("x is required: numpy arrays (with y), a data function, or a path (as --dataset)")
    if sample_weight is not None and not (_is_array(x) or isinstance(x, dict)):
        raise UserError("sample_weight goes with x arrays; a data function returns (x, y, sample_weight) itself")
    if _is_array(x) or isinstance(x, dict):
        if y is None:
            raise UserError("x arrays need y: the labels or targets, one per row")
        x = _input_array(x, "x")
        rows = len(next(iter(x.values())) if isinstance(x, dict) else x)
        y = _labels(y, "y", rows)
        w = None if sample_weight is None else _labels(sample_weight, "sample_weight", rows).astype(np.float32)
        if validation_data is not None:
            train, val = (x, y) + (() if w is None else (w,)), _validation_pair(validation_data)
        elif validation_split > 0:
            from app.data.arrays import split_last

            train, val = split_last(x, y, validation_split, w)
        else:
            # The product's seeded val_fraction holdout (the module docstring says why).
            train, val = (x, y) + (() if w is None else (w,)), None
        return {"dataset": _given_arrays(train, val)}
    if isinstance(x, (list, tuple)):
        _input_array(x, "x")  # refused there: several inputs by position
    if y is not None:
        raise UserError(f"y goes with x arrays; x is a {type(x).__name__}, which carries its own labels")
    if isinstance(x, (str, os.PathLike)):
        if validation_split > 0:
            raise UserError("validation_split takes the last rows of x arrays (as in Keras); with a path, set "
                            "val_fraction (a seeded random holdout) or validation_data (a path, as --val-dataset)")
        if validation_data is not None and not isinstance(validation_data, (str, os.PathLike)):
            raise UserError("with x a path, validation_data is a path too (as --val-dataset), not "
                            f"a {type(validation_data).__name__}")
        return {"dataset": os.fspath(x), **({"val_dataset": os.fspath(validation_data)} if validation_data else {})}
    if is_tf_dataset(x):
        if validating:
            raise UserError("validation_data and validation_split take arrays: with a tf.data.Dataset as x, "
                            "give validation rows as a data function returning {'train': ds, 'val': ds_val}")
        return {"dataset": _given(x, "fit(tf.data.Dataset)")}
    if keras_stream.is_ray_dataset(x):
        if validating:
            raise UserError("with a ray.data.Dataset as x and a model that brings no step of its own, validation "
                            "rows are the seeded val_fraction holdout: leave out validation_data and validation_split")
        return {"dataset": _given(x, "fit(ray.data.Dataset)")}
    if callable(x):
        if validating:
            raise UserError("validation_data and validation_split take arrays: a data function returns "
                            "{'train': (x, y), 'val': (x_val, y_val)} to give its own validation rows")
        return {"dataset": x}
    raise UserError(f"x of type {type(x).__name__} is not supported: give numpy arrays (with y), a data function "
                    "(as data= in app.train) or a path (as --dataset)")


def _is_keras_model(value: Any) -> bool:
    """A built Keras model or layer (callable, so it would pass for a model function), told without importing Keras."""
    return any(c.__name__ in ("Model", "Layer") and c.__module__.startswith("keras") for c in type(value).__mro__)


def _is_array(value: Any) -> bool:
    """numpy arrays, and what converts to one without a copy of Python objects: tensors, DataFrames."""
    return isinstance(value, np.ndarray) or (hasattr(value, "__array__") and hasattr(value, "shape"))


def _input_array(value: Any, what: str) -> Any:
    """The model's input: an array, or a dict of arrays by input name (several named inputs)."""
    if isinstance(value, dict):
        return {str(k): _input_array(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        raise UserError(f"{what} is a {type(value).__name__} of {len(value)}, which Keras reads as several model "
                        "inputs by position: give a dict keyed by the model's input names")
    if not _is_array(value):
        raise UserError(f"{what} of type {type(value).__name__} is not supported: give a numpy array")
    return np.asarray(value)


def _labels(value: Any, what: str, rows: int) -> Any:
    if isinstance(value, dict):  # several named outputs
        return {str(k): _labels(v, f"{what}[{k!r}]", rows) for k, v in value.items()}
    if not _is_array(value):
        raise UserError(f"{what} of type {type(value).__name__} is not supported: give a numpy array of labels")
    labels = np.asarray(value)
    if labels.ndim == 2 and labels.shape[1] == 1:  # (n, 1), as Keras's sparse losses take it
        labels = labels[:, 0]
    if len(labels) != rows:
        raise UserError(f"{what} has {len(labels)} rows but its x has {rows}")
    return labels


def _validation_pair(value: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(value, (tuple, list)) and len(value) == 3:
        raise UserError("validation_data with sample weights (x_val, y_val, weights) is not supported: give "
                        "(x_val, y_val)")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UserError(f"validation_data must be (x_val, y_val) arrays (got a {type(value).__name__})")
    xv = _input_array(value[0], "validation_data's x")
    return xv, _labels(value[1], "validation_data's y", len(next(iter(xv.values())) if isinstance(xv, dict) else xv))


def _given_arrays(train: tuple, val: Optional[tuple]) -> Callable[[], Any]:
    """The arrays as a data function of no arguments (what the data layer takes): explicit train and val rows
    when validation rows were given, else (x, y[, w]) for the seeded holdout."""
    return _given(train if val is None else {"train": train, "val": val}, "fit(x, y)")


def replicas(config: TrainConfig) -> tuple[int, str]:
    """How many replicas a global batch is split over, and why that many."""
    backend = backend_of(config)
    if backend.replicas is not None:
        return backend.replicas, backend.replicas_why
    if not backend.counts_gpus:  # a TPU
        raise UserError("batch_size with --strategy tpu: the TPU's cores are not known before it starts; give "
                        "per_replica_batch= instead")
    from app import tf_import

    tf_import.install()
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))
    return max(1, gpus), f"{gpus} GPU(s)" if gpus else "the CPU, one replica"


def _with_global_batch(config_file: Optional[str], values: dict[str, Any], batch_size: Optional[int]) -> TrainConfig:
    """The config, with batch_size (global) as per_replica_batch for the run's replicas."""
    if batch_size is not None and "per_replica_batch" in values:
        raise UserError("batch_size is the global batch and per_replica_batch each replica's: give one")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise UserError(f"batch_size must be a positive integer (got {batch_size!r})")
    if "per_replica_batch" in values:
        return build_config(config_file, values)
    batch = batch_size or KERAS_BATCH_SIZE
    # Validated first as it is (one output directory for both builds), then with the batch split.
    probe = build_config(config_file, {**values, "per_replica_batch": batch})
    if probe.elastic:  # the replicas follow the cluster: each size takes its equal part of the global batch
        return build_config(config_file, {**values, "output": probe.output, "global_batch": batch})
    n, why = replicas(probe)
    if batch % n:
        below, above = batch // n * n, (batch // n + 1) * n
        nearest = f"{below} or {above}" if below else str(above)
        default = " (Keras's default)" if batch_size is None else ""
        raise UserError(f"batch_size {batch}{default} is the global batch and does not divide over {n} replicas "
                        f"({why}): use {nearest}")
    return build_config(config_file, {**values, "output": probe.output, "per_replica_batch": batch // n})
