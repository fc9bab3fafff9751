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
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from app.backend import backend_of
from app.config import build_config
from app.data import keras_inputs, keras_stream
from app.data.checks import refuse_unreadable
from app.errors import UserError
from app.run import fit_checks, fit_inputs, keras_plan
from app.run.fit_inputs import overrides_step
from app.training import default_compile

log = logging.getLogger(__name__)

KERAS_BATCH_SIZE = 32  # keras.Model.fit's default batch_size (both of app.fit's steps)


# The config fields a run by the model's own step takes (where and how it runs, and the product's features it
# carries); every other field is a built-in model's option, the data's (app.fit's x), the batch (batch_size) or the
# product's own loop's (parameter servers): ``refuse_for_fit`` says which.
KERAS_STEP_FIELDS = {"output", "overwrite", "resume", "seed", "cpus_per_worker", "memory_per_worker", "use_gpu", "backend",
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
DEFAULT_COMPILE_FIELDS = default_compile.COMPILE_FIELDS


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


@dataclass(frozen=True)
class FitArguments:
    """keras.Model.fit's own arguments, as a run of Keras's fit is given them (app.fit's, or a config's run)."""

    x: Any
    y: Any = None
    batch_size: Optional[int] = None
    epochs: int = 1
    validation_data: Any = None
    validation_split: float = 0.0
    callbacks: Optional[list] = None
    num_workers: Any = 2
    sample_weight: Any = None
    class_weight: Any = None
    verbose: Any = "auto"
    shuffle: Any = True
    initial_epoch: int = 0
    steps_per_epoch: Optional[int] = None
    validation_steps: Optional[int] = None
    validation_batch_size: Optional[int] = None
    validation_freq: Any = 1


def fit(model, model_fn: Any, args: FitArguments, fields: dict[str, Any], dry: bool = False,
        recorded: Optional[dict[str, Any]] = None, ray_run: Any = None, row_ids: Optional[np.ndarray] = None,
        recompile: Optional["default_compile.Recompile"] = None, local: Any = None):
    """``recorded``: config fields the run's config.yaml says instead (a run from a config: its own model, dataset
    and callbacks, so that --resume and jobs/evaluate.py read them back); ``ray_run``: a sweep trial's
    keras_fit.RayRun; ``row_ids``: the id of each row of arrays x (the audit's; else each row's position);
    ``recompile``: what the flags change in the compile() of a model the user compiled; ``local``: the
    LocalReplicas (app.training.strategy) to train under, made by app.run.config_run before any model is built."""
    from app import registry
    from app.backends import keras_fit
    from app.driver import time_report
    from app.training.keras_worker import KerasJob
    from app.ui import console

    time_report.begin()  # where the run's time goes is told from here (a script's: from its process's start)
    fit_checks.check_arguments(args)
    if (problem := registry.callbacks_problem(list(args.callbacks or []))) is not None:
        raise UserError(problem)
    if isinstance(model_fn, str):
        model_fn = registry.resolve(model_fn, registry.MODELS)
    config = build_config(fields.pop("config", None), {
        **fields, "model": model_fn, "dataset": given(None, "fit(x)"), "epochs": args.epochs,
        "num_workers": args.num_workers, "callbacks": None,
        "per_replica_batch": max(1, (args.batch_size or KERAS_BATCH_SIZE) // max(1, _fewest(args.num_workers))),
        **(recorded or {})})
    world = fit_checks.checked_world(config, args.x, args.validation_data, args.num_workers)
    train, datasets, config, args = _train_input(model, config, world, args, "val_fraction" in fields, row_ids)
    model_fn, defaults = _compile(model, model_fn, train, config, recompile)
    val = args.validation_data if "val" in datasets else None
    if val is not None:
        fit_inputs.same_structure(train, val)
    elif args.validation_data is not None:
        val = fit_inputs.validation(args.validation_data, args.validation_batch_size or args.batch_size or
                                    KERAS_BATCH_SIZE, args.validation_steps, train)
    fit_checks.check_run(config, model, train, world, args)
    features, compiled = _features(config, model, train, world, args.batch_size, args.epochs, defaults, recompile)
    shard, tensor, stages = _parallel(config, model, model_fn, train, world)
    job = KerasJob(model_fn=model_fn, train=train, val=val, epochs=args.epochs, initial_epoch=args.initial_epoch,
                   validation_freq=args.validation_freq, seed=config.seed, callbacks=list(args.callbacks or []) or None,
                   stall_timeout_s=config.stall_timeout_s, features=features, shard_optimizer=shard.stage,
                   task=defaults.task if defaults is not None else None, tensor=tensor, stages=stages,
                   checkpoint_every_steps=config.checkpoint_every_steps, audit=config.audit_sample_ids,
                   profile_steps=config.profile_steps, compiled=compiled)
    plan = keras_plan.lines(config, model, train, val, world, features, shard, tensor,
                            defaults.line(built_by_product(config.model)) if defaults else
                            recompile.line() if recompile is not None else compiled.line(), args.class_weight,
                            args.validation_freq, args.callbacks, args.x, args.validation_data, args.epochs, local,
                            stages)
    if dry:  # --dry-run: the plan, nothing trained or written
        return plan, config.output_dir()
    quiet = {0: console.silent, 2: console.no_bars}.get(args.verbose, contextlib.nullcontext)
    with quiet():
        run = keras_fit.run(config, dataclasses.replace(job, progress_bars=console.bars()), plan, datasets,
                            ray_run or keras_fit.RayRun(), local)
    return run, config.output_dir()


def _train_input(model, config, world: int, args: FitArguments, holdout: bool, row_ids: Optional[np.ndarray]):
    """The training input as every worker reads it (KerasData, or a streamed input's description), checked against
    the model: (it, the Ray Datasets streamed by name, the config (a streamed input's batch), the arguments with x
    and validation_data as read: a streamed one's description, or the rows validation_split held out)."""
    from app.ui import console

    x, y, validation_data, sample_weight = args.x, args.y, args.validation_data, args.sample_weight
    datasets: dict[str, Any] = {}
    columns: tuple[str, ...] = ()  # a path's or a Dataset's columns that are x (the refusals name them)
    if keras_stream.is_streamed(x) or keras_stream.is_streamed(validation_data):
        with console.for_people(config.show_logs):  # Ray Data's own lines stay off the console while it reads
            x, y, validation_data, datasets, columns, config = fit_inputs.streamed_inputs(
                config, world, x, y, validation_data, args.validation_split, sample_weight, args.class_weight,
                args.steps_per_epoch, args.validation_steps, args.batch_size, args.validation_batch_size, args.shuffle,
                holdout=holdout, default_batch=KERAS_BATCH_SIZE)
    elif holdout:
        raise UserError("val_fraction holds out a seeded part of a path of files or a ray.data.Dataset: with x "
                        f"a {type(x).__name__}, give validation_split or validation_data, as in Keras")
    arrays = keras_inputs.is_array_input(x)
    if arrays and args.validation_split and validation_data is None:
        from app import internals

        refuse_unreadable(x, y, sample_weight, "x")  # before Keras's split, which refuses them in its own words
        try:
            (x, y, sample_weight), validation_data = internals.keras_validation_split((x, y, sample_weight),
                                                                                        args.validation_split)
        except ValueError as e:  # Keras's own words: too few rows for the split
            raise UserError(f"validation_split={args.validation_split}: {e}") from None
    elif args.validation_split and validation_data is None:
        raise UserError(f"validation_split takes the last rows of arrays, as in Keras; x is a {type(x).__name__}: "
                        "give validation_data instead")
    train = x if "train" in datasets else keras_inputs.read(
        x, y, sample_weight, batch_size=(args.batch_size or KERAS_BATCH_SIZE) if arrays else args.batch_size,
        shuffle=args.shuffle, steps_per_epoch=args.steps_per_epoch, class_weight=args.class_weight,
        epochs=args.epochs - args.initial_epoch, what="x", rerun=True)
    fit_inputs.check_audit(config, train, row_ids)
    fit_inputs.check_inputs(model, train, f"x (columns {', '.join(columns)})" if columns else "x")
    return train, datasets, config, dataclasses.replace(args, x=x, validation_data=validation_data)


def _features(config, model, train, world: int, batch_size: Optional[int], epochs: int, defaults, recompile):
    """The run's features as Keras provides them (app.training.keras_features), and the record of what trains
    (app.training.compile_record)."""
    from app.training import compile_record
    from app.training.keras_features import KerasFeatures

    # the product's optimizer (its compile's, or --optimizer's over the user's): the LR rule's defaults apply to it
    product_optimizer = defaults is not None or recompile is not None and recompile.optimizer is not None
    features = KerasFeatures.of(config, batch_size=_global_batch(train, world, batch_size),
                                steps_per_epoch=train.steps, epochs=epochs, product_optimizer=product_optimizer)
    features.check()
    by = compile_record.BY_PRODUCT if defaults is not None else compile_record.BY_FLAGS if recompile is not None \
        else compile_record.BY_MODEL
    return features, compile_record.of(model, by, config.model_fields_set, features, config)


def _parallel(config, model, model_fn, train, world: int) -> tuple[Any, Any, Any]:
    """What the run splits over its workers or devices: (ZeRO's sharding, the tensor-parallel plan or None, the
    pipeline's stages or None), each checked; and metrics that add up over the workers."""
    from app.training import keras_sync, tensor_parallel, zero, zero_memory

    optimizers = keras_sync.optimizers_of(model)
    if world > 1:  # the metrics' states are summed over the workers: only sums and counts add up
        keras_sync.check_additive(model, train.first_batch(), keras_steps=not overrides_step(model))
    shard = zero.sharding(model, optimizers, config.shard_optimizer, world)
    lines = zero_memory.plan(model, world) if shard.stage == 3 else shard.lines
    shard = zero.Sharding(shard.stage, lines + fit_checks.memory_lines(config, model, optimizers, world))
    tensor = tensor_parallel.plan_in_place(model, getattr(model_fn, "__name__", model.name), config, len(optimizers),
                                           _on_ray(config), train.first_batch()) if config.tensor_degree else None
    return shard, tensor, _stages(config, model, model_fn, train)


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
