"""app.fit for a model that brings its own step: checks fit()'s arguments as Keras does, reads the inputs, and
trains with app.backends.keras_fit (each worker runs the model's own fit(); app.training.keras_sync makes them one
exact run). A model brings its step when it is compiled (``model.compile(...)``: its optimizer, losses, metrics)
or overrides ``train_step``; one that compiles nothing is compiled with the task's defaults
(app.training.default_compile) and trains the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Optional

import numpy as np

from app.backend import backend_of
from app.config import build_config
from app.data import keras_inputs, keras_stream
from app.data.checks import refuse_unreadable
from app.errors import UserError
from app.run import fit_inputs, keras_plan
from app.run.fit_inputs import overrides_step
from app.training import default_compile

log = logging.getLogger(__name__)

KERAS_BATCH_SIZE = 32  # keras.Model.fit's default batch_size (both of app.fit's steps)


# The config fields a run by the model's own step takes (where and how it runs, and the product's features it
# carries); every other field is a built-in model's option, the data's (app.fit's x), the batch (batch_size) or the
# product's own loop's (parameter servers): ``refuse_for_fit`` says which.
KERAS_STEP_FIELDS = {"output", "overwrite", "resume", "seed", "cpus_per_worker", "use_gpu", "backend",
                     "stall_timeout_s", "keep_checkpoints", "max_failures", "storage_path", "worker_start_timeout_s",
                     "placement_strategy", "show_logs", "config",
                     # how a streamed input's columns become x and y (app.data.keras_stream) and how it streams
                     "label_column", "class_names", "feature_columns", "inputs", "data_format", "feature_shape", "image_size",
                     "image_channels", "text_column", "vocab_size", "sequence_length", "shuffle_buffer",
                     "stream_buffer_mib", "data_cache",
                     # the product's features that Keras provides itself (app.training.keras_features)
                     "grad_accum", "mixed_precision", "lr_scaling", "reference_batch", "warmup_epochs", "lr_decay",
                     # the optimizer's state cut over the workers (app.training.zero); layers split over each
                     # worker's devices (app.training.tensor_parallel)
                     "shard_optimizer", "tensor_parallel", "tensor_layout",
                     # step checkpoints and elastic resizes (app.training.keras_worker)
                     "checkpoint_every_steps", "resize_check_s",
                     # TensorBoard's step scalars (app.training.keras_callbacks.StepScalars); the profiler's steps
                     # (app.training.step_clock.Profile)
                     "log_every_steps", "profile_steps",
                     # every epoch's training row ids over the workers (app.training.keras_audit)
                     "audit_sample_ids",
                     # the run's records: TensorBoard's scalars, the SavedModel (app.backends.keras_record)
                     "tensorboard", "tensorboard_dir", "export"}
# ... with --strategy pipeline (backend="local"), its devices and how it cuts and runs a batch
PIPELINE_FIELDS = {"strategy", "devices", "split_at", "pipeline_microbatches"}
# ... and with a model that compiles nothing, what the product compiles it with (app.training.default_compile)
DEFAULT_COMPILE_FIELDS = {"optimizer", "base_lr", "momentum", "task", "loss", "from_logits", "steps_per_execution"}


def refuse_for_fit(fields: dict[str, Any], model_fn: Any) -> None:
    """Refuse in one line app.fit's keywords ``fields`` (outside KERAS_STEP_FIELDS) that Keras's fit, which trains
    the model ``model_fn`` builds, does not take, saying what to give instead; an unknown one in the config's words."""
    from app.config import TrainConfig
    from app.training.model import BUILTIN_OPTIONS

    if unknown := set(fields) - set(TrainConfig.model_fields):
        build_config(None, dict.fromkeys(unknown, True))  # its line names the key (whatever its value) and the valid
    name = getattr(model_fn, "__name__", model_fn)
    field = sorted(fields)[0]
    if field in ("per_replica_batch", "global_batch"):
        raise UserError(f"{field}: app.fit's batch_size is the global batch, as model.fit's (each worker trains its "
                        "equal part): give batch_size instead")
    if field in ("dataset", "val_dataset"):
        raise UserError(f"{field}: app.fit's data is x (and validation_data): give it there")
    if field in (*BUILTIN_OPTIONS, "model_args", "num_classes"):
        raise UserError(f"{field} sizes the built-in models (and functions of the product's arguments: input_shape, "
                        f"num_classes, ...); {name} takes no arguments and builds its own model: leave it out")
    raise UserError(f"{', '.join(sorted(fields))}: for a pipeline (backend='local', strategy='pipeline') or "
                    "parameter servers (strategy='parameter-server'); Keras's fit trains this run on neither: "
                    "leave it out")


def model_that_brings_its_step(model_fn: Any) -> Optional[Any]:
    """The model ``model_fn`` builds, if it is compiled or overrides Keras's step; else None."""
    model = keras_model_of(model_fn)
    return model if model is not None and brings_its_step(model) else None


def brings_its_step(model) -> bool:
    """Compiled, or overriding a part of Keras's step: what Keras's fit trains as it is (else the product compiles
    it: app.training.default_compile)."""
    return bool(getattr(model, "compiled", False) or overrides_step(model))


def keras_model_of(model_fn: Any, tensor_parallel: Optional[int] = None) -> Optional[Any]:
    """The Keras model ``model_fn`` builds when called with no arguments; None for a built-in name, a function that
    takes the product's arguments (input_shape, num_classes, ...: its own step fills them) or one that returns no
    Keras model. ``tensor_parallel`` N: this process's CPU split into N devices first, if its TensorFlow has not
    started yet (the build starts it), for a run in this process to split the model over."""
    from app import registry, tf_import

    if not callable(model_fn):
        if not isinstance(model_fn, str) or model_fn in registry.MODELS:
            return None
        model_fn = registry.resolve(model_fn, registry.MODELS)
    if _needs_arguments(model_fn):  # the product's convention (input_shape, num_classes, ...): its step fills them
        return None
    tf_import.install()
    if isinstance(tensor_parallel, int) and tensor_parallel > 1:
        from app.training.strategy import split_for_tensor_parallel

        split_for_tensor_parallel(tensor_parallel)
    import keras

    from app import internals

    restore_names = internals.keep_keras_names()  # the run's own build, in this process too, names as model.fit's
    try:
        model = model_fn()
    except Exception as e:  # the user's own code: one line naming it, the traceback chained
        name = getattr(model_fn, "__qualname__", type(model_fn).__name__)
        raise UserError(keras_inputs.raised(e, f"the model function {name}")) from e
    finally:
        restore_names()
    return model if isinstance(model, keras.Model) else None


def built_by_product(model_fn: Any) -> bool:
    """A built-in model's name, or a function that takes the product's arguments (input_shape, num_classes, ...):
    the product builds it for the data (app.training.model.build_model)."""
    from app import registry

    if isinstance(model_fn, str):
        return model_fn in registry.MODELS or _needs_arguments(registry.resolve(model_fn, registry.MODELS))
    return callable(model_fn) and _needs_arguments(model_fn)


def _needs_arguments(fn: Any) -> bool:
    """Whether ``fn`` has a parameter without a default (a call with none would raise)."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: try the call
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in parameters)


def fit(model, model_fn: Any, x: Any, y: Any, *, batch_size: Optional[int], epochs: int, validation_data: Any,
        validation_split: float, callbacks: Optional[list], num_workers: int, sample_weight: Any, class_weight: Any,
        verbose: Any, shuffle: Any, initial_epoch: int, steps_per_epoch: Optional[int], validation_steps: Optional[int],
        validation_batch_size: Optional[int], validation_freq: Any, fields: dict[str, Any], dry: bool = False,
        recorded: Optional[dict[str, Any]] = None, ray_run: Any = None, row_ids: Optional[np.ndarray] = None,
        recompile: Optional["default_compile.Recompile"] = None, local: Any = None):
    """``recorded``: config fields the run's config.yaml says instead (a run from a config: its own model, dataset
    and callbacks, so that --resume and jobs/evaluate.py read them back); ``ray_run``: a sweep trial's
    keras_fit.RayRun; ``row_ids``: the id of each row of arrays x (the audit's; else each row's position);
    ``recompile``: what the flags change in the compile() of a model the user compiled; ``local``: the
    LocalReplicas (app.training.strategy) to train under, made by app.run.config_run before any model is built."""
    from app import registry
    from app.backends import keras_fit, run_checkpoints
    from app.driver import outputs, time_report
    from app.training.keras_worker import KerasJob
    from app.ui import console

    time_report.begin()  # where the run's time goes is told from here (a script's: from its process's start)
    _check_arguments(model, epochs, initial_epoch, validation_freq, verbose, num_workers, validation_split, x,
                     counts={"batch_size": batch_size, "validation_batch_size": validation_batch_size,
                             "steps_per_epoch": steps_per_epoch, "validation_steps": validation_steps})
    if (problem := registry.callbacks_problem(list(callbacks or []))) is not None:
        raise UserError(problem)
    if isinstance(model_fn, str):
        model_fn = registry.resolve(model_fn, registry.MODELS)
    config = build_config(fields.pop("config", None), {
        **fields, "model": model_fn, "dataset": given(None, "fit(x)"), "epochs": epochs, "num_workers": num_workers,
        "callbacks": None, "per_replica_batch": max(1, (batch_size or KERAS_BATCH_SIZE) // max(1, _fewest(num_workers))),
        **(recorded or {})})
    run_checkpoints.check_resumable(config)  # before the data is read and anything starts
    # An elastic range (num_workers="1:4"): every size cuts each global batch over its workers, so the math does not
    # change with the size; the checks below take the largest.
    world = 1 if not _on_ray(config) else config.max_workers
    if _on_ray(config):  # the local Ray this would start cannot hold the workers: said now, not after a wait
        from app.driver import cluster

        cluster.check_fits_locally(config)
    if config.elastic and (keras_stream.is_streamed(x) or keras_stream.is_streamed(validation_data)):
        raise UserError(f"num_workers={num_workers!r}: a path or a ray.data.Dataset is split into equal shares of a "
                        "fixed number of workers; give num_workers a number")
    if config.checkpoint_every_steps and keras_stream.is_streamed(x):
        raise UserError(f"checkpoint_every_steps={config.checkpoint_every_steps}: a path or a ray.data.Dataset streams "
                        "each epoch anew, so a run cannot go on from a step inside one; leave it out (every epoch is "
                        "checkpointed), or give the rows in memory")
    datasets: dict[str, Any] = {}
    columns: tuple[str, ...] = ()  # a path's or a Dataset's columns that are x (the refusals name them)
    if keras_stream.is_streamed(x) or keras_stream.is_streamed(validation_data):
        with console.for_people(config.show_logs):  # Ray Data's own lines stay off the console while it reads
            x, y, validation_data, datasets, columns, config = fit_inputs.streamed_inputs(
                config, world, x, y, validation_data, validation_split, sample_weight, class_weight, steps_per_epoch,
                validation_steps, batch_size, validation_batch_size, shuffle, holdout="val_fraction" in fields,
                default_batch=KERAS_BATCH_SIZE)
    elif "val_fraction" in fields:
        raise UserError("val_fraction holds out a seeded part of a path of files or a ray.data.Dataset: with x "
                        f"a {type(x).__name__}, give validation_split or validation_data, as in Keras")
    arrays = keras_inputs.is_array_input(x)
    if arrays and validation_split and validation_data is None:
        from app import internals

        refuse_unreadable(x, y, sample_weight, "x")  # before Keras's split, which refuses them in its own words
        try:
            (x, y, sample_weight), validation_data = internals.keras_validation_split((x, y, sample_weight),
                                                                                        validation_split)
        except ValueError as e:  # Keras's own words: too few rows for the split
            raise UserError(f"validation_split={validation_split}: {e}") from None
    elif validation_split and validation_data is None:
        raise UserError(f"validation_split takes the last rows of arrays, as in Keras; x is a {type(x).__name__}: "
                        "give validation_data instead")
    if "train" in datasets:
        train = x
    else:
        train = keras_inputs.read(x, y, sample_weight, batch_size=(batch_size or KERAS_BATCH_SIZE) if arrays else
                                  batch_size, shuffle=shuffle, steps_per_epoch=steps_per_epoch,
                                  class_weight=class_weight, epochs=epochs - initial_epoch, what="x", rerun=True)
    fit_inputs.check_audit(config, train, row_ids)
    fit_inputs.check_inputs(model, train, f"x (columns {', '.join(columns)})" if columns else "x")
    model_fn, defaults = _compile(model, model_fn, train, config, recompile)
    val = None
    if "val" in datasets:
        val = validation_data
        fit_inputs.same_structure(train, val)
    elif validation_data is not None:
        val = fit_inputs.validation(validation_data, validation_batch_size or batch_size or KERAS_BATCH_SIZE, validation_steps,
                          train)
    outputs.check_output_dir(config)
    done = run_checkpoints.epochs_done(config)
    if done >= epochs:
        raise UserError(f"the run in {config.output_dir()} already finished its {done} epochs: give --epochs (epochs=) "
                        f"more than {done} to train it further with --resume (resume=True)")
    if done:  # a damaged checkpoint, or a model that is not the checkpoint's: said before any worker starts
        run_checkpoints.check_fits(model, config)
    if train.num_batches and train.steps and train.dropped_rows(world) >= train.num_rows:
        raise UserError(f"every batch of x has fewer rows than the {world} workers: use fewer workers or larger "
                        "batches")
    from app.training import compile_record, keras_sync, tensor_parallel, zero
    from app.training.keras_features import KerasFeatures

    # the product's optimizer (its compile's, or --optimizer's over the user's): the LR rule's defaults apply to it
    product_optimizer = defaults is not None or recompile is not None and recompile.optimizer is not None
    features = KerasFeatures.of(config, batch_size=_global_batch(train, world, batch_size),
                                steps_per_epoch=train.steps, epochs=epochs, product_optimizer=product_optimizer)
    features.check()
    compiled = compile_record.of(model, compile_record.BY_PRODUCT if defaults is not None else compile_record.BY_FLAGS
                                 if recompile is not None else compile_record.BY_MODEL, config.model_fields_set,
                                 features, config)
    optimizers = keras_sync.optimizers_of(model)
    if world > 1:  # the metrics' states are summed over the workers: only sums and counts add up
        keras_sync.check_additive(model, train.first_batch(), keras_steps=not overrides_step(model))
    shard = zero.sharding(model, optimizers, config.shard_optimizer, world)
    tensor = tensor_parallel.plan_in_place(model, getattr(model_fn, "__name__", model.name), config, len(optimizers),
                                           _on_ray(config), train.first_batch()) if config.tensor_degree else None
    stages = _stages(config, model, model_fn, train)
    if config.checkpoint_every_steps and (train.pipeline is not None or not train.counted):
        raise UserError(f"checkpoint_every_steps={config.checkpoint_every_steps}: a run goes on from a step inside an "
                        f"epoch of arrays (or a PyDataset) only; x is a {type(x).__name__}, whose epochs run anew: leave "
                        "it out (every epoch is checkpointed)")
    _check_profile_steps(config, train, epochs)
    job = KerasJob(model_fn=model_fn, train=train, val=val, epochs=epochs, initial_epoch=initial_epoch,
                   validation_freq=validation_freq, seed=config.seed, callbacks=list(callbacks or []) or None,
                   stall_timeout_s=config.stall_timeout_s, features=features, shard_optimizer=shard.stage,
                   task=defaults.task if defaults is not None else None, tensor=tensor, stages=stages,
                   checkpoint_every_steps=config.checkpoint_every_steps, audit=config.audit_sample_ids,
                   profile_steps=config.profile_steps, compiled=compiled)
    plan = keras_plan.lines(config, model, train, val, world, features, shard, tensor,
                            defaults.line(built_by_product(config.model)) if defaults else
                            recompile.line() if recompile is not None else compiled.line(), class_weight,
                            validation_freq, callbacks, x, validation_data, epochs, local, stages)
    if dry:  # --dry-run: the plan, nothing trained or written
        return plan, config.output_dir()
    quiet = {0: console.silent, 2: console.no_bars}.get(verbose, contextlib.nullcontext)
    with quiet():
        run = keras_fit.run(config, dataclasses.replace(job, progress_bars=console.bars()), plan, datasets,
                            ray_run or keras_fit.RayRun(), local)
    return run, config.output_dir()


def _check_profile_steps(config, train, epochs: int) -> None:
    """--profile-steps inside the run's steps (where they are known before it starts), else one line."""
    if config.profile_steps is None or not train.steps:
        return
    first, last = config.profile_steps
    total = train.steps * epochs
    if last > total:
        raise UserError(f"--profile-steps {first}:{last}: the run has {total} steps ({epochs} epoch(s) of "
                        f"{train.steps}); give steps from 1 to {total}, for example {min(first, total)}:{total}")


def _compile(model, model_fn, train, config, recompile) -> tuple[Any, Optional["default_compile.Defaults"]]:
    """The driver's model compiled as every worker's will be (the product's defaults for a model that compiles
    nothing and brings no step, else the flags' ``recompile`` over its own compile, if any), its names and labels
    checked; the model function every worker calls, and the defaults (None: the model's own compile)."""
    defaults = None if brings_its_step(model) else _compiled_with_defaults(model, train, config)
    if defaults is not None:
        model_fn = default_compile.CompiledWithDefaults(model_fn, defaults)
    elif recompile is not None:
        recompile.compile(model)
        model_fn = default_compile.CompiledWithDefaults(model_fn, recompile)
    default_compile.check_names(model)
    fit_inputs.check_labels(model, train, getattr(model_fn, "__name__", ""))
    return model_fn, defaults


def _compiled_with_defaults(model, train, config) -> "default_compile.Defaults":
    """The driver's model compiled with the product's defaults, decided from every label it holds (a streamed input
    or a pipeline that reads files: its first batch's)."""
    import keras

    first = train.first_batch()
    every = train.rows if getattr(train, "counted", True) and not getattr(train, "streamed", False) else first
    defaults = default_compile.decide(model, first, keras.utils.unpack_x_y_sample_weight(every)[1], config)
    defaults.compile(model)
    return defaults


def given(data: Any, name: str) -> Callable[[], Any]:
    def arrays():
        return data

    # How the data layer's lines name it ("app:fit(x, y) returned ..."), and config.yaml: not a loadable name.
    arrays.__module__, arrays.__qualname__ = "app", name
    return arrays


def _on_ray(config) -> bool:
    return backend_of(config).on_ray


def _stages(config, model, model_fn: Any, train) -> Any:
    """--strategy pipeline's plan (app.training.pipeline): one stage per device, said before the run; else None."""
    from app.training.pipeline import plan_for_fit
    from app.training.strategy import stage_devices

    if not backend_of(config).pipeline:
        return None
    return plan_for_fit(model, getattr(model_fn, "__name__", model.name), overrides_step(model), config.split_at,
                        stage_devices(), config.pipeline_microbatches, train.first_batch())


def _check_arguments(model, epochs: int, initial_epoch: int, validation_freq: Any, verbose: Any, num_workers: Any,
                     validation_split: float, x: Any, counts: dict[str, Any]) -> None:
    for name, value in counts.items():  # None: Keras's default
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise UserError(f"{name} must be a positive integer, or None for Keras's default (got {value!r})")
    if verbose not in (0, 1, 2, "auto") or isinstance(verbose, bool):
        raise UserError(f"verbose must be 0, 1, 2 or 'auto', as in Keras's fit (got {verbose!r})")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise UserError(f"epochs must be a positive integer (got {epochs!r})")
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        raise UserError(f"initial_epoch must be an integer from 0 to epochs - 1 = {epochs - 1} (got {initial_epoch!r}): "
                        "epochs counts from 0, as in Keras, so it is the last epoch's number, not how many to train")
    if isinstance(validation_freq, bool) or not (isinstance(validation_freq, int) and validation_freq >= 1 or
                                                  isinstance(validation_freq, (list, tuple)) and validation_freq):
        raise UserError(f"validation_freq must be a positive integer (validate every that many epochs) or a list of "
                        f"epoch numbers (from 1), as in Keras (got {validation_freq!r})")
    if isinstance(num_workers, bool) or isinstance(num_workers, int) and num_workers < 1:
        raise UserError(f"num_workers must be a positive integer, or a range MIN:MAX for an elastic run (got "
                        f"{num_workers!r})")
    if not 0 <= validation_split < 1:
        raise UserError(f"validation_split must be in [0, 1) (got {validation_split!r})")


def _fewest(num_workers: Any) -> int:
    """The fewest workers a run has: N, or an elastic range's MIN (the config validates the range itself)."""
    from app import config_scale

    try:
        return config_scale.sizes(config_scale.parse_workers(num_workers))[0]
    except (ValueError, TypeError, UserError):
        return 1


def _global_batch(train, world: int, batch_size: Optional[int]) -> int:
    """Rows of one step over every worker: a streamed input's worker batch x workers; arrays' batch_size; a
    dataset's own batches (their first one's rows)."""
    if getattr(train, "streamed", False):
        return train.batch * train.world
    if train.batch_size is not None:
        return train.batch_size
    return int(train.bounds[1] - train.bounds[0]) if len(train.bounds) > 1 else (batch_size or KERAS_BATCH_SIZE)
