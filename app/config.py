"""One typed, validated run configuration, in sections.

`TrainConfig` is the single source of truth for a run: the YAML file, the
command line (generated from these fields by app.cli, grouped by section),
the Python API, Tune search spaces and what every worker receives all use
these field names. The sections (app.config_sections) are mixins of one flat model, so a YAML file
and a search space stay flat (``per_replica_batch: 64``) while ``--help`` and
the code read by concern. Range checks are pydantic constraints; the cross-
field rules are in ``TrainConfig._check``. Validated once, frozen after.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError, field_serializer, model_validator

from app import config_scale, registry
from app.config_sections import (
    PIPELINE_MICROBATCHES,
    TENSOR_SPLITS,
    CallbacksSpec,
    DataSection,
    ModelSection,
    OptimSection,
    OutputSection,
    Plugin,
    RunSection,
)
from app.errors import UserError

CONFIG_FILE = "config.yaml"  # every run writes its config there; --resume reads it back


class TrainConfig(OutputSection, OptimSection, ModelSection, DataSection, RunSection):
    """Everything that defines a training run (the sections' fields, flat)."""

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        problems = []
        for name in ("dataset", "val_dataset"):
            value = getattr(self, name)
            if isinstance(value, str) and not registry.is_dataset_name(value):
                problems.append(
                    f"unknown {name} {value!r} (choose from {', '.join(sorted(registry.DATASETS))}, give a "
                    "path or URI to parquet, CSV, image-folder, .npz or .npy data, or file.py:function)"
                )
        if (problem := registry.callbacks_problem(self.callbacks)) is not None:
            problems.append(problem)
        if self.val_dataset in registry.DATASETS:
            problems.append("val_dataset must be a path or URI (built-in datasets split off --val-fraction)")
        if isinstance(self.model, str) and not registry.is_model_name(self.model):
            problems.append(
                f"unknown model {self.model!r} (choose from {', '.join(sorted(registry.MODELS))}, or give "
                "file.py:function or package.module:function)"
            )
        if self.embed_dim % self.num_heads:
            problems.append(f"embed_dim {self.embed_dim} must be a multiple of num_heads {self.num_heads}")
        if self.backend == "ray" and self.strategy not in ("auto", "parameter-server"):
            problems.append(f"--strategy {self.strategy} is a local strategy: use it with --backend local (on Ray: "
                            "auto = MultiWorkerMirroredStrategy, or parameter-server)")
        if self.backend == "local" and self.strategy == "parameter-server":
            problems.append("--strategy parameter-server runs on Ray actors: use it with --backend ray")
        if self.strategy != "parameter-server" and (self.num_ps != 1 or self.cpus_per_ps != 1.0):
            problems.append("--num-ps and --cpus-per-ps are for --strategy parameter-server")
        if self.strategy == "parameter-server" and (self.grad_accum > 1 or self.steps_per_execution > 1):
            problems.append("--strategy parameter-server applies every step's gradients at once: leave --grad-accum "
                            "and --steps-per-execution at 1")
        if self.strategy == "parameter-server" and self.shard_optimizer:
            problems.append("--shard-optimizer cuts the optimizer's state over synchronous workers; with "
                            "--strategy parameter-server the parameter servers already hold it apart: leave it out")
        if self.strategy == "parameter-server" and self.audit_sample_ids:
            problems.append("--audit-sample-ids gathers ids across synchronous replicas: not with parameter-server")
        if self.strategy == "parameter-server" and self.mixed_precision == "fp16":
            problems.append("--strategy parameter-server: use --mixed-precision bf16 or off (fp16's loss scaling "
                            "needs one decision across replicas per step)")
        if self.backend == "ray" and self.devices is not None:
            problems.append("--devices splits a local CPU: use it with --backend local")
        if self.strategy != "pipeline" and (self.split_at or self.pipeline_microbatches != PIPELINE_MICROBATCHES):
            problems.append("--split-at and --pipeline-microbatches are for --strategy pipeline")
        problems.extend(_tensor_parallel_problems(self))
        if self.audit_sample_ids and self.steps_per_execution > 1:
            problems.append("audit_sample_ids needs steps_per_execution 1 (ids are gathered per step)")
        if set(self.export) - {"keras", "savedmodel"}:
            problems.append(f"--export takes keras and/or savedmodel (keras,savedmodel), got {','.join(self.export)}")
        elif "keras" not in self.export:  # evaluate, predict, resume and app.fit's History all read model.keras
            problems.append("--export savedmodel alone leaves no model.keras, which evaluate, predict, resume and "
                            "app.fit read: give --export keras,savedmodel")
        if self.inputs is not None:
            problems.extend(_inputs_problems(self))
        problems.extend(_builtin_data_problems(self))
        problems.extend(_scale_problems(self))
        if self.resume and self.overwrite:
            problems.append("--resume continues a run and --overwrite replaces it: pick one")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="before")
    @classmethod
    def _model_optimizer(cls, values: Any) -> Any:  # a built-in model's own optimizer, where the run sets none
        if isinstance(values, dict):
            model = values.get("model", cls.model_fields["model"].default)
            own = registry.MODEL_OPTIMIZERS.get(model) if isinstance(model, str) else None
            if own and values.get("optimizer", own["optimizer"]) == own["optimizer"]:  # its LR is for its optimizer
                values = {**own, **values}
        return values

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values: Any) -> Any:  # config.yaml of a run made before the rename
        if isinstance(values, dict) and "verbose" in values and "show_logs" not in values:
            values = {k: v for k, v in values.items() if k != "verbose"} | {"show_logs": values["verbose"]}
        return values

    @model_validator(mode="before")
    @classmethod
    def _split_at_commas(cls, values: Any) -> Any:  # --split-at a,b = --split-at a b = split_at: "a,b" in YAML
        if isinstance(values, dict) and isinstance(values.get("inputs"), dict):  # {input: column} from Python, YAML
            values = {**values, "inputs": [f"{k}={v}" for k, v in values["inputs"].items()]}
        for name in ("split_at", "export", "inputs"):
            cut = values.get(name) if isinstance(values, dict) else None
            if isinstance(cut, (str, list)):
                parts = [p for c in ([cut] if isinstance(cut, str) else cut) for p in str(c).split(",") if p]
                values = {**values, name: parts}
        return values

    @field_serializer("model", "dataset", "callbacks")
    def _plugin_name(self, value: Optional[Plugin | CallbacksSpec]) -> Optional[str]:
        # A function (or a list of callbacks) given from Python is recorded by name in config.yaml and result.json.
        return value if value is None or isinstance(value, str) else registry.describe(value)

    def input_columns(self) -> dict[str, str]:
        """--inputs as {model input name: file column} ({} without it): NAME reads the column NAME."""
        pairs = (item.split("=", 1) for item in self.inputs or [])
        return {pair[0]: pair[-1] for pair in pairs}

    def output_dir(self) -> Path:
        return Path(self.output).expanduser().resolve()

    def to_yaml(self) -> str:
        # With --global-batch the per-replica batch is derived at each size: recorded, it would read as set.
        derived = {"per_replica_batch"} if self.global_batch is not None else None
        return yaml.safe_dump(self.model_dump(mode="json", exclude=derived), sort_keys=False)

    def at_size(self, replicas: int) -> "TrainConfig":
        """The config ``replicas`` replicas train with: with --global-batch, each one's equal part of it."""
        if self.global_batch is None:
            return self
        per, left = divmod(self.global_batch, replicas * self.grad_accum)
        if left or not per:
            raise UserError(config_scale.split_problem(self.global_batch, self.grad_accum, range(replicas, replicas + 1),
                                                       "replica")
                            or f"--global-batch {self.global_batch} is smaller than the {replicas} replicas")
        return self.model_copy(update={"per_replica_batch": per})


def _scale_problems(config: TrainConfig) -> list[str]:
    """The cross-field rules of the run's width: worker range, global batch, step checkpoints (app.config_scale)."""
    found = []
    low, high = config.min_workers, config.max_workers
    if config.elastic and config.backend != "ray":
        found.append(f"--num-workers {low}:{high} is for Ray workers: use it with --backend ray (a local run's "
                     "replicas are its devices)")
    elif config.elastic and config.strategy == "parameter-server":
        found.append(f"--num-workers {low}:{high}: parameter-server runs have a fixed number of workers; give one "
                     "number")
    if config.global_batch is not None and "per_replica_batch" in config.model_fields_set:
        found.append("--global-batch and --per-replica-batch both set the batch: give one (--global-batch keeps the "
                     "global batch at every worker count)")
    synchronous_ray = config.backend == "ray" and config.strategy != "parameter-server"
    split = config.global_batch is not None and synchronous_ray and config_scale.split_problem(
        config.global_batch, config.grad_accum, config_scale.sizes(config.num_workers))
    if split:
        found.append(split)
    if config.global_batch is not None and config.strategy == "parameter-server":
        found.append("--global-batch: a parameter-server update is one worker's batch; give --per-replica-batch")
    # A file written by to_yaml holds every field: a value other than the default is what was asked for.
    if not config.elastic and config.resize_check_s != TrainConfig.model_fields["resize_check_s"].default:
        found.append(f"--resize-check-s is how often an elastic run (--num-workers MIN:MAX) looks for room to grow; "
                     f"this run has a fixed {config.num_workers} worker(s): leave it out")
    if config.checkpoint_every_steps is not None:
        if config.backend != "ray" or config.strategy == "parameter-server":
            found.append("--checkpoint-every-steps checkpoints Ray Train's synchronous workers inside an epoch: use "
                         "it with --backend ray and the default strategy (other runs checkpoint every epoch)")
        elif config.checkpoint_every_steps % config.steps_per_execution:
            found.append(f"--checkpoint-every-steps {config.checkpoint_every_steps} must be a multiple of "
                         f"--steps-per-execution {config.steps_per_execution} (steps run in groups of that many)")
    return found


def _tensor_parallel_problems(config: "TrainConfig") -> list[str]:
    """--tensor-parallel and --tensor-layout: what they combine with."""
    n = config.tensor_degree
    if n is None:  # no split; with --tensor-parallel 1 (a split run resumed on one device) its layout is unused
        return ["--tensor-layout names the layers --tensor-parallel N splits: add --tensor-parallel N"] \
            if config.tensor_layout and config.tensor_parallel is None else []
    problems = []
    if config.strategy != "auto":
        problems.append(f"--tensor-parallel {n} trains one replica split over devices: leave out --strategy")
    if config.devices is not None and config.devices != n:
        problems.append(f"--tensor-parallel {n} splits the CPU into {n} logical devices itself: leave out --devices")
    if config.mixed_precision == "fp16":
        problems.append(f"--tensor-parallel {n} with --mixed-precision fp16 (a loss-scaled optimizer) is not built: "
                        "use --mixed-precision bf16 or off")
    bad = [item for item in config.tensor_layout or []
           if item.count("=") != 1 or item.split("=")[1] not in TENSOR_SPLITS or not item.split("=")[0]]
    if bad:
        problems.append(f"--tensor-layout takes LAYER=column, LAYER=row, LAYER=heads or LAYER=replicated items, got "
                        f"{' '.join(bad)}")
    return problems


def _inputs_problems(config: TrainConfig) -> list[str]:
    problems = []
    names = [item.split("=", 1)[0] for item in config.inputs or []]
    if not names or any(not part for item in config.inputs for part in item.split("=", 1)):
        problems.append(f"--inputs takes NAME or NAME=COLUMN items, one per model input, got {config.inputs}")
    elif len(set(names)) != len(names):
        problems.append(f"--inputs names an input twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    else:
        columns = config.input_columns()
        for name, column in columns.items():
            if column == config.label_column:
                problems.append(f"--inputs {name}={column}: {column!r} is the label column (--label-column): give "
                                f"input {name!r} a feature column, or name the label column with --label-column")
        read_by: dict[str, list[str]] = {}
        for name, column in columns.items():
            read_by.setdefault(column, []).append(name)
        for column, names_of in read_by.items():
            if len(names_of) > 1:  # one column cannot be two inputs of one row table
                problems.append(f"--inputs reads column {column!r} into {len(names_of)} inputs ({', '.join(names_of)}): "
                                "give each input a column of its own (NAME=COLUMN)")
    for flag, value in (("--feature-columns", config.feature_columns), ("--text-column", config.text_column),
                        ("--feature-shape", config.feature_shape)):
        if value:
            problems.append(f"--inputs gives each named input its column: leave out {flag}")
    return problems


# File-column flags: a built-in dataset is arrays, with no columns for them to name.
_COLUMN_FLAGS = ("feature_columns", "inputs", "text_column", "label_column", "data_format")


def _builtin_data_problems(config: TrainConfig) -> list[str]:
    """Column flags given with a built-in dataset: they would be ignored, so they are refused."""
    if not (isinstance(config.dataset, str) and config.dataset in registry.DATASETS):
        return []
    given = [name for name in _COLUMN_FLAGS if getattr(config, name) != TrainConfig.model_fields[name].default]
    if not given:
        return []
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    return [f"{flags}: the built-in dataset {config.dataset!r} is arrays with no columns to name; leave "
            f"{'it' if len(given) == 1 else 'them'} out, or give --dataset your files"]


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _one_line(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {loc!r} (see python jobs/train.py --help for the valid keys)")
        elif e["type"] in _BOUNDS and loc:
            bound = next(iter(e["ctx"].values()))
            parts.append(f"{loc} must be {_BOUNDS[e['type']]} {bound} (got {e.get('input')!r})")
        elif loc:
            parts.append(f"{loc}: {msg} (got {e.get('input')!r})")
        else:
            parts.append(msg)
    return "invalid config: " + "; ".join(parts)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 integers: ``num_workers: 1:2`` is the range 1:2, not 62."""


_INT = "tag:yaml.org,2002:int"
_Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag != _INT]
                                   for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# PyYAML's own int pattern, its base-60 alternative left out.
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)"
                                               r"|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config YAML file into a dict, with one-line errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), _Loader)  # a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"config file {str(path)!r} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of field: value, got {type(data).__name__}")
    return data


def new_output(kind: str) -> str:
    """Where a job writes when not told: runs/<kind>-<time> under the working directory; -2, -3, ... after it when
    that name is taken (a script's second app.fit in the same second)."""
    name, taken = f"runs/{kind}-{_dt.datetime.now():%Y%m%d-%H%M%S}", 1
    while Path(name if taken == 1 else f"{name}-{taken}").exists():
        taken += 1
    return name if taken == 1 else f"{name}-{taken}"


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) < explicit overrides, validated once."""
    values: dict[str, Any] = read_yaml(file) if file else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if not values.get("output"):
        values["output"] = new_output("train")
    try:
        return TrainConfig(**values)
    except ValidationError as e:
        raise UserError(_one_line(e)) from None
