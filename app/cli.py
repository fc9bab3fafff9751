"""Command-line flags generated from TrainConfig, so flags, YAML keys and --help never drift apart."""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from typing import Any, Callable

from app.config import TrainConfig
from app.errors import RunFailed, UserError


def add_config_flags(parser, exclude: frozenset[str] | set[str] = frozenset()) -> None:
    """One --flag-name per TrainConfig field; every default is None (= keep the file's or the field's default)."""
    if "config" not in exclude:
        parser.add_argument("--config", metavar="FILE", help="YAML file of config fields; flags override it.")
    for name, field in TrainConfig.model_fields.items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        default = field.default_factory() if field.default_factory else field.default
        help_text = f"{field.description} (default: {default})"
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif origin is typing.Literal:
            parser.add_argument(flag, dest=name, choices=list(args), default=None, help=help_text)
        elif origin is list:
            parser.add_argument(flag, dest=name, type=args[0], nargs="+", default=None, help=help_text)
        else:
            scalar = next((a for a in args if a is not type(None)), annotation) if args else annotation
            parser.add_argument(flag, dest=name, type=scalar, default=None, help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """--config file < flags; with --resume and no --config, the run's own config.yaml is the file."""
    from pathlib import Path

    from app.config import build_config
    from app.report import CONFIG_FILE

    overrides = {name: getattr(args, name, None) for name in TrainConfig.model_fields}
    file = getattr(args, "config", None)
    if overrides["resume"] and not file:
        if not args.output:
            raise UserError("--resume needs --output: the directory of the run to continue")
        file = Path(args.output) / CONFIG_FILE
        if not file.is_file():
            raise UserError(f"nothing to resume: {str(args.output)!r} holds no {CONFIG_FILE}")
    return build_config(file, overrides)


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
