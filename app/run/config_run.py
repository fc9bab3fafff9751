"""A run from the command line or ``app.train`` (one config) on Keras's fit: ``jobs/train.py --model file.py:build``
with a model function of no arguments (a compiled model, one overriding ``train_step``, or one that compiles nothing)
trains as ``app.fit(build, x, ...)`` trains it (app.run.keras_step), whatever the data:

- a path of files (or a ray.data.Dataset a data function returns): streamed to the workers by Ray Data, as
  ``app.fit(build, path, validation_data=val_path)`` (a built-in model on Ray too, built for the facts of one
  statistics pass, its validation the seeded ``val_fraction`` where no --val-dataset is given);
- a built-in dataset or a data function's arrays (``(x, y)``, ``(x, y, sample_weight)``, ``{"train": ..., "val":
  ...}``, a DataFrame): read here with the same checks as every in-memory source (app.data.memory), the seeded
  ``val_fraction`` held out where the function gives no "val" part, then ``app.fit(build, x, y,
  validation_data=(x_val, y_val), sample_weight=w)``;
- a built-in model's files on the local backend: read here into arrays (app.data.local_files), the seeded
  ``val_fraction`` held out as a Ray run holds it out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from app.errors import UserError
from app.run import keras_step
from app.run.fit_inputs import overrides_step
from app.run.keras_step import DEFAULT_COMPILE_FIELDS, KERAS_STEP_FIELDS, PIPELINE_FIELDS
from app.training import model as product_model

# What a run from the command line (or app.train) decides as the run does, not as Keras's fit: fields it sets for
# every run, besides KERAS_STEP_FIELDS.
_CONFIG_RUN_FIELDS = {"model", "dataset", "val_dataset", "epochs", "num_workers", "per_replica_batch", "global_batch",
                      "callbacks", "shuffle", "val_fraction", "class_weight", "export", "tensorboard",
                      "tensorboard_dir",
                      # what the built-in datasets take (app.data.builtin)
                      "synthetic_rows", "synthetic_shape", "synthetic_classes", "synthetic_text_rows"}
# ... and what the product's model functions take (a built-in's options, --model-args), with such a model.
_BUILT_FIELDS = {*product_model.BUILTIN_OPTIONS, "model_args", "num_classes"}
# What config.yaml records of a run from a config even at its default: what --resume and jobs/evaluate.py read back.
_ALWAYS_RECORDED = {"model", "dataset", "callbacks", "per_replica_batch"}


def _chosen_for_keras_fit(config, backend) -> Optional[set[str]]:
    """The fields the run set that Keras's fit takes its part of (those that only name the backend left out); None:
    the run is the own loop's (parameter servers); a field for neither is one line."""
    from app.backend import several_replicas_asked

    several = _several_local_replicas(config)
    one_replica = not backend.on_ray and backend.replicas == 1 and not backend.pipeline
    # --devices on one replica (--devices 1, --tensor-parallel N --devices N) asks for nothing Keras's fit lacks; a
    # strategy of several replicas on one device is the own step's to refuse
    one_device = one_replica and not several_replicas_asked(config)
    chosen = set(config.model_fields_set) - ({"strategy"} if one_replica else set()) \
        - (PIPELINE_FIELDS if backend.pipeline else set()) \
        - ({"devices"} if one_device else set()) \
        - ({"strategy"} if backend.ray_train else set()) - ({"strategy", "devices"} if several else set())
    if others := chosen - KERAS_STEP_FIELDS - _CONFIG_RUN_FIELDS - DEFAULT_COMPILE_FIELDS - _BUILT_FIELDS:
        flags = ', '.join('--' + f.replace('_', '-') for f in sorted(others))
        if backend.ray_train:
            raise UserError(f"{flags}: for --backend local (several local devices, a pipeline) or --strategy "
                            "parameter-server, not Ray Train's workers: leave it out")
        if not backend.own_loop:
            from app.backends.local import make_strategy

            make_strategy(config)  # a strategy this machine cannot make is its own line
            raise UserError(f"{flags}: not for --backend local --strategy {config.strategy}: leave it out")
        return None
    return chosen


def _resumed_by_own_loop(config, backend) -> bool:
    """--resume of a run with no checkpoint of Keras's fit: True for a parameter servers' run, which goes on on the
    own loop (or whose resume says what is wrong with its checkpoint); one line for an own loop's checkpoint given to
    any other run, or for a run whose checkpoints are gone."""
    if _resumes_keras_run(config):
        return False
    own = _own_step_checkpoints(config, quiet=backend.own_loop)
    if backend.own_loop and own is not False:
        return True
    if own is not False:
        raise UserError(f"--resume: the run in {config.output_dir()} holds checkpoints of the product's own loop, "
                        "which goes on only as the parameter servers (--strategy parameter-server) it trains; "
                        "Keras's fit, which trains every other run, cannot go on from them: give a new --output")
    from app.backends import run_checkpoints

    run_checkpoints.check_resumable(config)  # a run whose checkpoints are gone: nothing to go on from
    return False


def _built_in(config, backend, dry: bool) -> tuple[Any, Any, Any, Any]:
    """A built-in model (or a function of the product's arguments) built for the data's facts: (model, its model
    function, the data, the facts). On local replicas or a pipeline it trains by Keras's fit, as on Ray (files read
    here into arrays); --tensor-parallel N splits its layers inside the model Keras's fit runs
    (app.training.tensor_parallel.SplitInPlace), by the built-in's own layout unless --tensor-layout names one."""
    if config.tensor_degree and not backend.on_ray:  # this process's CPU split before its TensorFlow starts
        from app.training.strategy import tensor_devices

        tensor_devices(config.tensor_degree)
    data = _data(config, None, dry)
    facts = _streamed_facts(config, data) if data.streamed else data.facts
    if data.streamed and config.class_weight is not None:  # weighed on the workers by the classes' facts
        from app.training.objective import class_weights

        data.class_weight = dict(enumerate(class_weights(config, facts)))
    model_fn = functools.partial(product_model.build_model, config, facts)
    model = model_fn()
    product_model.check_output(model, product_model.task_with_model(facts, model), product_model.model_name(config))
    return model, model_fn, data, facts


def _recompile(config, model, chosen: set[str]) -> tuple[Any, set[str]]:
    """The flags' changes to the user's own compile() (--optimizer, --base-lr, --loss, ...), the rest as given, and
    the fields Keras's fit then takes."""
    import keras

    from app.training.default_compile import recompile_of

    asked = chosen & DEFAULT_COMPILE_FIELDS
    own = overrides_step(model) + (["compile"] if type(model).compile is not keras.Model.compile else [])
    if asked and own:  # a step of its own reads what its own compile() set: nothing here to change in it
        raise UserError(f"--{sorted(asked)[0].replace('_', '-')}: the product's compile, and "
                        f"{getattr(config.model, '__name__', config.model)} trains by its own {', '.join(own)}: "
                        "leave it out")
    return (recompile_of(model, config, asked) if asked else None), KERAS_STEP_FIELDS


def _fit_fields(config, chosen: set[str], taken: set[str], data, backend, built_facts) -> dict[str, Any]:
    """The config's fields keras_step.fit is given (``built_facts``: a built-in's facts read from streamed files)."""
    # --val-fraction holds out a seeded part of streamed files where it is given (arrays were split in _data)
    fields = {**{k: getattr(config, k) for k in chosen & (taken | ({"val_fraction"} if data.streamed else set()))},
              **({k: getattr(config, k) for k in PIPELINE_FIELDS} if backend.pipeline else {}),
              "output": str(config.output_dir())}
    if built_facts is not None and config.val_dataset is None:
        fields["val_fraction"] = config.val_fraction  # a built-in's files hold out validation rows, as its arrays do
    known = data.facts if data.facts is not None else built_facts
    if known is not None and known.class_names:
        # the ids of a label column's class names, decided reading the training rows: the workers map the names
        # with them, and config.yaml records them for evaluation and prediction
        fields["class_names"] = list(known.class_names)
    if config.tensor_degree and not config.tensor_layout and isinstance(config.model, str):
        from app.training.tensor_parallel import BUILTIN_LAYOUTS  # a built-in's own layout, named

        if config.model in BUILTIN_LAYOUTS:
            fields["tensor_layout"] = [f"{k}={v}" for k, v in BUILTIN_LAYOUTS[config.model].items()]
    return fields


def from_config(config, dry: bool = False, ray_run: Any = None) -> Optional[Any]:
    """The run ``config`` asks for, trained by Keras's fit: a model function of no arguments returning a Keras model,
    on any data; a built-in model or a function of the product's arguments (input_shape, num_classes, ...: built
    for the data's facts, app.training.model) on any data, on Ray or on local replicas (one, or several under
    Mirrored, central storage or a TPU's strategy). Returns result.json's content. None: the run is the product's
    loop (parameter servers, and --resume of their runs), never on Ray Train, where what Keras's
    fit cannot run is one line. ``dry``: the plan's lines instead, nothing
    trained (--dry-run); ``ray_run``: a sweep trial's app.backends.keras_fit.RayRun."""
    from app.backend import backend_of, one_local_replica

    # Parameter servers are a field set: the product's own loop; one asking for local replicas or a pipeline is what
    # Keras's fit in this process is.
    backend = backend_of(config)
    if config.resume and _resumed_by_own_loop(config, backend):
        return None
    if (config.elastic or config.checkpoint_every_steps) and backend.on_ray:
        from app.data import files

        if files.streams(files.located(config), on_ray=True):  # said before a Ray starts to read them
            raise UserError(files.STEP_EXACT.format(what=f"--dataset {config.dataset}"))
    chosen = _chosen_for_keras_fit(config, backend)
    if chosen is None:
        return None
    # Several local replicas (Mirrored over GPUs or --devices CPUs, a TPU's cores): the strategy made before any model
    # is built (TensorFlow's devices are set as it starts; the run builds its model in the strategy's scope).
    local = local_replicas(config)
    replicas = local.replicas if local is not None else 1
    model, model_fn, data = keras_step.keras_model_of(config.model, config.tensor_parallel), config.model, None
    built_on_files, facts = False, None  # a built-in on streamed files: its validation is the seeded holdout
    if model is None:
        if not keras_step.built_by_product(config.model) and not backend.own_loop:
            raise UserError(f"--model {getattr(config.model, '__name__', config.model)} builds no Keras model: give a "
                            "built-in's name or a function that returns a keras.Model")
        if not keras_step.built_by_product(config.model) or not (
                backend.on_ray or backend.pipeline or local is not None or one_local_replica(config)):
            return None
        model, model_fn, data, facts = _built_in(config, backend, dry)
        built_on_files = data.streamed
    elif chosen & _BUILT_FIELDS:  # a function of no arguments takes none of them
        flag = sorted(chosen & _BUILT_FIELDS)[0]
        raise UserError(f"--{flag.replace('_', '-')} sizes the built-in models (and functions of the product's "
                        f"arguments: input_shape, num_classes, ...); {getattr(config.model, '__name__', config.model)} "
                        "takes no arguments and builds its own model: leave it out")
    recompile, taken = _recompile(config, model, chosen) if model_fn is config.model and \
        keras_step.brings_its_step(model) else (None, KERAS_STEP_FIELDS | DEFAULT_COMPILE_FIELDS)
    from app.training import callbacks as product_callbacks

    data = data or _data(config, model, dry)
    if data.streamed and config.class_weight is not None and data.class_weight is None:
        # A model of the user's own on files: the weights as given, as app.fit(path, class_weight={...}) takes them
        # (the labels' classes are known only as the workers read them)
        from app.training.objective import given_class_weights

        data.class_weight = given_class_weights(config.class_weight)
    fields = _fit_fields(config, chosen, taken, data, backend, facts if built_on_files else None)
    # Keras's fit is given the global batch (the rows of an update) over the steps it accumulates, which stays at
    # every size of an elastic range (its per-replica batch is the fewest workers' part); --global-batch splits over
    # the replicas and the steps (TrainConfig.at_size)
    batch = config.global_batch // config.grad_accum if config.global_batch \
        else config.per_replica_batch * (config.min_workers if backend.on_ray else replicas)
    if not data.streamed:  # a batch behind an update larger than the rows: the own step's refusal, in its words
        from app.driver.preflight import checked_plan

        checked_plan(config, data.rows, config.min_workers if backend.on_ray else 1, 1 if backend.on_ray else replicas)
    args = keras_step.FitArguments(
        data.x, data.y, batch_size=batch, epochs=config.epochs, validation_data=data.validation,
        callbacks=product_callbacks.load(config) if config.callbacks else None, num_workers=config.num_workers,
        sample_weight=data.sample_weight, class_weight=data.class_weight, shuffle=config.shuffle)
    run, _ = keras_step.fit(
        model, model_fn, args, fields, dry=dry, ray_run=ray_run, row_ids=data.ids, recompile=recompile, local=local,
        # config.yaml: the run's own fields (its global batch as the per-worker batch Keras's fit is given)
        recorded={k: getattr(config, k) for k in config.model_fields_set - {"global_batch"} | _ALWAYS_RECORDED
                  if k not in fields})
    return run if dry else run.result


def _several_local_replicas(config) -> bool:
    """Whether ``config`` asks for a strategy of several local replicas that Keras's fit trains under (Mirrored,
    central storage, or what --strategy auto finds: several GPUs, a TPU's cores). Not a Ray run, and not parameter
    servers, a pipeline or --tensor-parallel (one replica, split in place). Read without starting TensorFlow."""
    from app.backend import backend_of, one_local_replica

    backend = backend_of(config)
    return not (backend.on_ray or backend.own_loop or backend.pipeline or config.tensor_degree
                or one_local_replica(config))


def local_replicas(config) -> Any:
    """The strategy of several local replicas ``config`` asks for, made now (before any model is built: TensorFlow's
    devices are set as it starts), as a LocalReplicas; None where it asks for none, or finds one replica after all.
    A pipeline's devices, one per stage, are made here too (its one replica needs no strategy). What Keras's fit
    cannot do over such replicas is one line."""
    from app.backend import backend_of
    from app.backends.local import make_strategy

    if backend_of(config).pipeline:
        make_strategy(config)
        return None
    if not _several_local_replicas(config):
        return None
    if config.shard_optimizer:
        raise UserError(f"--shard-optimizer {config.shard_optimizer}: the optimizer's state is cut over Ray's workers; "
                        "the replicas of a local strategy in this process each hold it whole: leave it out, or train "
                        "on Ray's workers (--backend ray)")
    from app.training import strategy as strategy_lib

    strategy, reason = make_strategy(config)
    return strategy_lib.LocalReplicas(strategy, reason) if strategy.num_replicas_in_sync > 1 else None


def local_replicas_of(fields: dict[str, Any]) -> Any:
    """``local_replicas`` of app.fit's keywords (its backend, strategy, devices, ...: several GPUs found by
    ``strategy="auto"`` on the local backend, Mirrored, a TPU's, a pipeline's devices)."""
    config = _where_asked(fields)
    return local_replicas(config) if config is not None else None


def backend_asked(fields: dict[str, Any]) -> Any:
    """The Backend (app.backend) app.fit's keywords ask for (None: they name none): its own loop (parameter servers),
    a pipeline, ..."""
    from app.backend import backend_of

    config = _where_asked(fields)
    return backend_of(config) if config is not None else None


def _where_asked(fields: dict[str, Any]) -> Any:
    """The config of app.fit's keywords that say where and how wide it trains (None: none given)."""
    from app.config import build_config

    asked = {k: fields[k] for k in ("backend", "strategy", "devices", "cpus_per_worker", "grad_accum",
                                    "shard_optimizer", "tensor_parallel") if k in fields}
    return build_config(fields.get("config"), asked) if asked else None


def _streamed_facts(config, data: "_Data"):
    """A built-in model's data facts of streamed files (or a data function's Ray Dataset), read by Ray Data's tasks
    (app.data.streamed.built_in_facts)."""
    from app.data import memory, streamed
    from app.data.files import given_dataset
    from app.driver import cluster

    cluster.connect_for_data(config, reads=True)
    given = given_dataset("the data function's ray.data.Dataset", data.x) if memory.is_ray_dataset(data.x) else None
    return streamed.built_in_facts(config, given)


def _own_step_checkpoints(config, quiet: bool) -> Optional[bool]:
    """Whether ``config``'s output holds a checkpoint of the product's own step. One it cannot read: None when
    ``quiet`` (the own step's resume names it), else that one line."""
    from app.driver import resume

    try:
        return resume.latest(config) is not None
    except UserError:
        if not quiet:
            raise
        return None


def _resumes_keras_run(config) -> bool:
    """--resume of a run Keras's fit trained (or of none yet: the run starts as a new one would)."""
    from app.backends import run_checkpoints
    from app.config import CONFIG_FILE

    out = config.output_dir()
    return bool(run_checkpoints.checkpoints(out, config.storage_path)) or not (out / CONFIG_FILE).is_file()


@dataclass
class _Data:
    """What keras_step.fit takes of the config's dataset."""

    x: Any
    y: Any = None
    sample_weight: Any = None
    validation: Any = None
    class_weight: Optional[dict[int, float]] = None
    streamed: bool = False  # files or a ray.data.Dataset, read by the workers
    facts: Any = None  # arrays' DataFacts (app.data.arrays)
    rows: Optional[int] = None  # the training rows of arrays read here
    ids: Any = None  # their ids (the audit's: --audit-sample-ids)


def _data(config, model, dry: bool = False) -> _Data:
    """Files and Ray Datasets as they are (the workers stream them); arrays read and checked here (their named inputs
    and outputs against the model's, where Keras's own step feeds them to it), --class-weight from their labels."""
    from app import registry
    from app.backend import backend_of
    from app.data import files, memory
    from app.training.objective import class_weights

    loc = files.located(config)  # None: a built-in dataset or a data function
    if loc is not None and loc.format != "numpy" and (model is not None or backend_of(config).on_ray):
        # numpy files load in memory (app.data.numpy_files); the others stream on Ray, and a model function's are
        # read by app.fit's own reader on the local backend
        return _Data(config.dataset, validation=config.val_dataset, streamed=True)
    if loc is None and not dry and backend_of(config).on_ray and (
            not isinstance(config.dataset, str) or registry.is_plugin(config.dataset)):
        from app.driver import cluster

        # Before a data function runs: a ray.data.Dataset it builds is of this Ray and seals Ray Data's context as
        # made here (its progress bars off), as the product's own step connects first too.
        cluster.connect_for_data(config, reads=False)
    returned = memory.call_data_function(config) if loc is None else None
    if memory.is_ray_dataset(returned):
        return _Data(returned, validation=config.val_dataset, streamed=True)
    if loc is not None and loc.format != "numpy":  # a built-in's files on the local backend: read here, the seeded
        from app.data import local_files  # val_fraction held out as a Ray run holds it out
        from app.driver import named_inputs

        # (a function of the product's arguments whose keras.Input names are columns: each reads its own)
        source = local_files.load(named_inputs.by_name(config, loc), loc)
    else:
        source = memory.load_source(config, returned)
    if model is not None and not overrides_step(model):
        name = product_model.model_name(config)
        product_model.check_inputs(model, source.facts, name)
        product_model.check_output_names(model, source.facts, name)
    train, val = source.train, source.val
    weights = class_weights(config, source.facts)
    return _Data(train.x, train.y, train.w, (val.x, val.y) if len(val) else None,
                 dict(enumerate(weights)) if weights is not None else None, facts=source.facts, rows=len(train),
                 ids=train.ids)
