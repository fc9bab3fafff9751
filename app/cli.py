"""The command line, generated from TrainConfig by tyro, one group per config section.

Why tyro: it reads the pydantic sections themselves (types, Literal choices,
Optional lists, descriptions, defaults) and parses lists the way users type
them (``--feature-columns f0``, ``--feature-columns f0 f1 f2``,
``--synthetic-shape 8 8 3``), bools as ``--shuffle/--no-shuffle``; nesting the
sections with ``OmitArgPrefixes`` keeps flat flags (``--num-workers``) while
``--help`` groups them. jsonargparse wants ``--x+ a`` or JSON for lists and
pydantic-settings repeats the flag per item; both break command lines users
and the README already type. Two things are ours: ``--model-args`` and the
plug-in fields take one string each (a registry rule), and tyro's boxed error
panels become the product's one ``error:`` line.

Precedence: field defaults < ``--config FILE`` (or, with ``--resume``, the
run's own config.yaml) < flags. The file is read first and handed to tyro as
the defaults, so a flag the user did not type keeps the file's value.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Optional

from app.config import SECTIONS, Plugin, TrainConfig, build_config, read_yaml
from app.errors import RunFailed, UserError

CONFIG_FILE = "config.yaml"  # what every run writes into its output directory (app.run.outputs)


def _registry():
    import tyro
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def one_string(info: PrimitiveTypeInfo):
        # --model-args '{"width": 64}' is one JSON object; --model / --dataset one name or path.
        if typing.get_origin(info.type) is dict:
            return PrimitiveConstructorSpec(
                nargs=1, metavar="JSON", instance_from_str=lambda a: _json_object(a[0]),
                is_instance=lambda x: isinstance(x, dict), str_from_instance=lambda d: [json.dumps(d)],
            )
        if info.type == Plugin:
            return PrimitiveConstructorSpec(
                nargs=1, metavar="NAME", instance_from_str=lambda a: a[0], is_instance=lambda x: True,
                str_from_instance=lambda v: [v if isinstance(v, str) else repr(v)],
            )
        return None

    return tyro, registry


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-args must be a JSON object such as '{{\"width\": 64}}' ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--model-args must be a JSON object such as '{{\"width\": 64}}', got {text}")
    return value


def _sections_class(fields: set[str]):
    """A dataclass with one member per section (its flags grouped under the section's docstring)."""
    import tyro

    # Plain dataclasses mirroring the sections' fields: tyro parses and types the
    # values, and TrainConfig validates them once, with the product's messages.
    members = []
    for section in SECTIONS:
        keep = [
            (name, typing.Annotated[f.annotation, tyro.conf.arg(help=f.description)], dataclasses.field(default=None))
            for name, f in section.model_fields.items() if name in fields
        ]
        if keep:
            name = section.__name__.removesuffix("Section")
            cls = dataclasses.make_dataclass(name, keep)
            cls.__doc__ = section.__doc__
            members.append((name.lower(), cls))
    return dataclasses.make_dataclass("Options", members), [c for _, c in members]


_BOX = re.compile(r"[╭╮╰╯│─]+")


def _one_line(panel: str) -> str:
    """tyro's boxed error panel -> one line (pydantic details shortened to '(got ...)')."""
    lines = []
    for raw in panel.splitlines()[1:]:  # the top border carries the panel's title
        line = _BOX.sub(" ", raw).strip()
        if line.startswith(("Argument helptext", "For full helptext")):
            break
        if line and not line.startswith(("For further information", "https://", "usage:")):
            lines.append(line)
    text = " ".join(lines)
    text = re.sub(r"\s*\[type=[^\]]*?input_value=([^,\]]*)[^\]]*\]", r" (got \1)", text)
    text = re.sub(r"Error parsing \w+: \d+ validation errors? for \w+ (\w+) ", r"\1: ", text)
    return re.sub(r"\s+", " ", text).strip() or "invalid command line (see --help)"


def _parse(description: str, argv: list[str], base: TrainConfig, fields: set[str]) -> TrainConfig:
    """tyro over the sections, with ``base`` as the defaults; errors become one UserError line."""
    tyro, registry = _registry()
    options_cls, sections = _sections_class(fields)
    default = options_cls(*(c(**{f.name: getattr(base, f.name) for f in dataclasses.fields(c)}) for c in sections))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            options = tyro.cli(tyro.conf.OmitArgPrefixes[options_cls], args=argv, default=default,
                               description=description, registry=registry, prog=Path(sys.argv[0]).name)
    except SystemExit as e:
        if e.code:
            raise UserError(_one_line(stderr.getvalue())) from None
        raise
    values = {k.name: getattr(getattr(options, f.name), k.name)
              for f in dataclasses.fields(options) for k in dataclasses.fields(getattr(options, f.name))}
    return build_config(None, {**base.model_dump(), **values})


def _typed(argv: list[str], fields: set[str]) -> set[str]:
    """The config fields the user typed as flags (for Tune's fixed values and overrides)."""
    typed = set()
    for token in argv:
        name = token.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if token.startswith("--no-"):
            name = name.removeprefix("no_")
        if token.startswith("--") and name in fields:
            typed.add(name)
    return typed


@dataclasses.dataclass
class TrainArgs:
    config: TrainConfig
    dry_run: bool


def train_args(description: str, argv: Optional[list[str]] = None) -> TrainArgs:
    """Every TrainConfig field as a flag, plus --config FILE and --dry-run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--dry-run", action="store_true")
    pre.add_argument("--resume", action="store_true")
    pre.add_argument("--output")
    known, rest = pre.parse_known_args(argv)
    rest = [a for a in rest] + (["--resume"] if known.resume else []) + (["--output", known.output] if known.output else [])

    def body() -> TrainConfig:
        file = known.config
        if known.resume and not file:
            if not known.output:
                raise UserError("--resume needs --output: the directory of the run to continue")
            file = Path(known.output) / CONFIG_FILE
            if not file.is_file():
                raise UserError(f"nothing to resume: {str(known.output)!r} holds no {CONFIG_FILE}")
        base = build_config(file, {})
        doc = f"{description}\n--config FILE: YAML of these fields (flags override it). --dry-run: print the plan."
        return _parse(doc, rest, base, set(TrainConfig.model_fields))

    return TrainArgs(_guarded(body), known.dry_run)


NOT_FOR_TUNE = {"output", "overwrite", "resume", "backend", "strategy", "devices", "storage_path"}


@dataclasses.dataclass
class TuneArgs:
    space: str
    num_samples: int
    scheduler: str
    metric: Optional[str]
    mode: Optional[str]
    max_concurrent: Optional[int]
    output: Optional[str]
    fixed: dict[str, Any]


def _own_and_config(argv, own: Callable[[argparse.ArgumentParser], None], doc: str, fields: set[str]):
    """(the script's own flags, the config flags the user typed) of a script that is not jobs/train.py."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    own(pre)
    known, rest = _guarded(lambda: pre.parse_known_args(argv))
    config = _guarded(lambda: _parse(doc, rest, build_config(None, {}), fields))
    return known, {k: getattr(config, k) for k in _typed(rest, fields)}


def _require(ok: bool, message: str) -> None:
    if not ok:
        _guarded(lambda: (_ for _ in ()).throw(UserError(message)))


def tune_args(description: str, argv: Optional[list[str]] = None) -> TuneArgs:
    """The sweep's own flags, and config flags fixed for every trial (only those typed)."""

    def own(pre: argparse.ArgumentParser) -> None:
        pre.add_argument("--space")
        pre.add_argument("--num-samples", type=int, default=1)
        pre.add_argument("--scheduler", choices=["asha", "fifo"], default="asha")
        pre.add_argument("--metric")
        pre.add_argument("--mode", choices=["max", "min"])
        pre.add_argument("--max-concurrent", type=int)
        pre.add_argument("--output")

    doc = (f"{description}\nSweep flags: --space FILE (required), --num-samples N, --scheduler asha|fifo, --metric, "
           "--mode max|min, --max-concurrent N, --output DIR. The flags below fix a value for every trial.")
    known, fixed = _own_and_config(argv, own, doc, set(TrainConfig.model_fields) - NOT_FOR_TUNE)
    _require(bool(known.space), "--space FILE is required (a search space: tune_spaces/)")
    return TuneArgs(known.space, known.num_samples, known.scheduler, known.metric, known.mode, known.max_concurrent,
                    known.output, fixed)


EVALUATE_FIELDS = {"dataset", "data_format", "val_dataset", "feature_columns", "label_column", "text_column",
                   "num_classes", "feature_shape", "image_size", "image_channels", "val_fraction", "vocab_size",
                   "sequence_length", "synthetic_text_rows", "synthetic_rows", "synthetic_shape", "synthetic_classes",
                   "seed", "per_replica_batch", "task", "loss", "from_logits"}


@dataclasses.dataclass
class EvaluateArgs:
    model: Optional[str]
    checkpoint: Optional[str]
    run: Optional[str]
    overrides: dict[str, Any]


def evaluate_args(description: str, argv: Optional[list[str]] = None) -> EvaluateArgs:
    """Exactly one of --model FILE.keras, --checkpoint DIR, --run DIR; data flags override the run's config."""

    def own(pre: argparse.ArgumentParser) -> None:
        what = pre.add_mutually_exclusive_group()
        what.add_argument("--model", dest="model_file")
        what.add_argument("--checkpoint")
        what.add_argument("--run")

    doc = (f"{description}\nWhat to evaluate: --model FILE.keras | --checkpoint DIR | --run DIR. The flags below "
           "override the run's data settings.")
    known, overrides = _own_and_config(argv, own, doc, EVALUATE_FIELDS)
    _require(bool(known.model_file or known.checkpoint or known.run),
             "give one of --model FILE.keras, --checkpoint DIR, --run DIR")
    return EvaluateArgs(known.model_file, known.checkpoint, known.run, overrides)


def _guarded(body: Callable[[], Any]) -> Any:
    """Parsing errors are user errors: one line, exit 2 (as main() does for the run itself)."""
    try:
        return body()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main(body: Callable[[], Any]) -> None:
    """Run an entry script: user errors become one line on stderr and exit status 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        body()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: continue the run with --output <dir> --resume", file=sys.stderr)
        sys.exit(130)


__all__ = ["train_args", "tune_args", "evaluate_args", "main", "read_yaml"]
