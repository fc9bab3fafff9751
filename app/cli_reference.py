"""docs/reference/cli.md, generated from the code: every job's flags, and every configuration field.

    python -m app.cli_reference            # print it
    python -m app.cli_reference --write    # write docs/reference/cli.md (tests/test_cli_reference.py: not stale)

It reads what the job scripts parse with: the scripts' own flags (the dataclasses of `app.cli`, the parser of
`app.bench.flags`), the configuration sections (`app.config_sections`), and which configuration flags each job
takes (`app.cli`: all for jobs/train.py, all but `NOT_FOR_TUNE` for jobs/tune.py, `EVALUATE_FIELDS` for
evaluate and predict). tests/test_cli_reference.py checks each job's flags against its own `--help`.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Optional

from app import cli
from app.bench import flags as bench_flags
from app.bench import suites
from app.config import TrainConfig
from app.config_sections import SECTIONS

REFERENCE = Path(__file__).resolve().parents[1] / "docs/reference/cli.md"
JOBS = ("train", "tune", "evaluate", "predict", "benchmark")

HEADER = """# Command-line reference

Generated from the code by `python -m app.cli_reference --write`; `tests/test_cli_reference.py` fails when this
file is stale, and checks each job's flags against what its `--help` prints. Every job runs from the repository
root (`python jobs/<job>.py --help` prints the same, by group).

- [`jobs/train.py`](#jobstrainpy): its own flags, then every [configuration flag](#configuration-flags).
- [`jobs/tune.py`](#jobstunepy): the sweep's flags; the configuration flags fix a value for every trial, but a few.
- [`jobs/evaluate.py`](#jobsevaluatepy) and [`jobs/predict.py`](#jobspredictpy): what to use, their own flags,
  and the data flags that override the run's configuration.
- [`jobs/benchmark.py`](#jobsbenchmarkpy): a suite, the flags every suite takes, each suite's own.
- [Configuration flags](#configuration-flags): each field of the typed configuration, as a flag, a `--config`
  YAML key and a keyword of `app.train(...)` and `app.fit(...)`, with the jobs that take it.
"""


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "\\|").split())


def _table(rows: list[tuple[str, str, str]], default: str = "default") -> list[str]:
    return [f"| flag | {default} | what it does |", "|---|---|---|",
            *(f"| `{flag}` | {default} | {_cell(help_)} |" for flag, default, help_ in rows), ""]


# --- the tyro jobs: their own flags, from the dataclasses app.cli parses them with ------------------------------


def _own_rows(own: type) -> list[tuple[str, str, str]]:
    """(flags, default, help) of each field of a script's own-flags dataclass, named as tyro names them."""
    import tyro

    hints = typing.get_type_hints(own, include_extras=True)
    rows = []
    for field in dataclasses.fields(own):
        kind, *marks = typing.get_args(hints[field.name]) or (hints[field.name],)
        arg = next((m for m in marks if hasattr(m, "help")), None)
        flag = "--" + field.name.replace("_", "-")
        if kind is bool and tyro.conf.FlagCreatePairsOff not in marks:
            flag += f", --no-{flag[2:]}"
        elif arg is not None and arg.metavar:
            flag += f" {arg.metavar}"
        elif choices := _choices(kind):
            flag += " {" + ",".join(choices) + "}"
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            default = "required"
        else:
            value = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            hint = (arg.help_behavior_hint or "") if arg is not None else ""
            default = hint.removeprefix("(").removesuffix(")").removeprefix("default: ") if hint else f"`{_text(value)}`"
            default = default or "none"
        rows.append((flag, default, arg.help if arg is not None else ""))
    return rows


def _choices(kind: Any) -> list[str]:
    """The values of a Literal (through Optional), as tyro lists them."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next((c for c in map(_choices, typing.get_args(kind)) if c), [])
    return [str(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is typing.Literal else []


def _fields_list(names: typing.Iterable[str]) -> str:
    return ", ".join(f"`--{n.replace('_', '-')}`" for n in sorted(names))


def _train() -> list[str]:
    return ["## jobs/train.py", "", "    python jobs/train.py [FLAGS]", "",
            "Train. Its own flags, then every [configuration flag](#configuration-flags).", "",
            *_table(_own_rows(cli._train_flags()))]


def _tune() -> list[str]:
    refused = [(f"--{name.replace('_', '-')}", why) for name, why in cli.NOT_FOR_TUNE.items()]
    return ["## jobs/tune.py", "", "    python jobs/tune.py --space FILE [FLAGS]", "",
            "A sweep with Ray Tune, every trial a Ray Train run. The sweep's own flags:", "",
            *_table(_own_rows(cli._tune_flags())),
            "Every other [configuration flag](#configuration-flags) fixes that value for every trial, except these, "
            "which jobs/tune.py refuses in one line (its `--output` is the sweep's directory, above):", "",
            "| flag | why a sweep does not take it |", "|---|---|",
            *(f"| `{flag}` | {_cell(why)} |" for flag, why in refused), ""]


def _evaluate_or_predict(job: str, own: type, usage: str, what: str) -> list[str]:
    rows = _own_rows(own)
    exactly_one = [row for row in rows if row[0].split()[0] in ("--model", "--checkpoint", "--run")]
    return [f"## jobs/{job}.py", "", f"    {usage}", "", what, "",
            "Exactly one of `--model`, `--checkpoint`, `--run` names the trained model:", "",
            *_table(exactly_one),
            *(["Its own flags:", "", *_table([row for row in rows if row not in exactly_one])]
              if len(rows) > len(exactly_one) else []),
            "The data flags below override the run's `config.yaml` (each as described under "
            f"[Configuration flags](#configuration-flags)): {_fields_list(cli.EVALUATE_FIELDS)}.", ""]


# --- jobs/benchmark.py: argparse, from app.bench.flags ----------------------------------------------------------


def _bench_rows(parser, skip: set[str]) -> list[tuple[str, str, str]]:
    rows = []
    for action in parser._actions:  # argparse keeps its arguments there; it has no public list of them
        name = action.option_strings[-1] if action.option_strings else None
        if name is None or name in skip:
            continue
        shown = "{" + ",".join(action.choices) + "}" if action.choices else action.metavar or action.dest.upper()
        takes = "" if action.nargs == 0 else f" {shown}"
        rows.append((name + takes, "", action.help or ""))
    return rows


def _benchmark() -> list[str]:
    top = bench_flags.parser()
    chooser = next(a for a in top._actions if a.choices and a.dest == "suite")
    # The flags every suite takes: those of the first suite that all the others have too.
    first, *others = chooser.choices.values()
    common = [row for row in _bench_rows(first, {"--help"})
              if all(row in _bench_rows(sub, {"--help"}) for sub in others)]
    lines = ["## jobs/benchmark.py", "", "    python jobs/benchmark.py [SUITE] [FLAGS]", "",
             "The measurements behind BENCHMARKS.md; no suite named is `throughput`. Each suite reads its section of a "
             "preset (`app/bench/presets/full.yaml`; `--quick`: `quick.yaml`): its own parameters, which its flags "
             "override, and the workload it trains (TrainConfig fields). Flags every suite takes:", "",
             *_table([(flag, "", help_) for flag, _, help_ in common])]
    taken = {flag.split()[0] for flag, _, _ in common} | {"--help"}
    for suite, sub in chooser.choices.items():
        full = suites.load_preset(suite).params
        own = [(flag, f"`{_text(full.get(flag.split()[0][2:].replace('-', '_')))}`", help_)
               for flag, _, help_ in _bench_rows(sub, taken)]
        lines += [f"### {suite}", "", _cell(sub.description or ""), ""]
        lines += [*_table(own, "default (full preset)")] if own else ["No flags of its own.", ""]
    return lines


# --- the configuration fields ----------------------------------------------------------------------------------


def _jobs_of(name: str) -> str:
    jobs = ["train"]
    if name not in cli.NOT_FOR_TUNE and name != "output":
        jobs.append("tune")
    if name in cli.EVALUATE_FIELDS:
        jobs += ["evaluate", "predict"]
    return ", ".join(jobs)


def _flag(name: str, annotation: Any) -> str:
    flag = f"--{name.replace('_', '-')}"
    return f"{flag}, --no-{flag[2:]}" if annotation in (bool, Optional[bool]) else flag


def _config() -> list[str]:
    lines = ["## Configuration flags", "",
             "Each field is a flag (the jobs in the last column take it), a key of a `--config` YAML file "
             "(`field_name: value`), and a keyword of `app.train(...)` and `app.fit(...)`. Precedence: the defaults "
             "below < `--config FILE` (with `--resume` and no `--config`: `<output>/config.yaml`) < the flags typed.",
             ""]
    assert set(TrainConfig.model_fields) == {n for s in SECTIONS for n in s.model_fields}
    for section in SECTIONS:
        title = section.__name__.removesuffix("Section")
        lines += [f"### {title}", "", (section.__doc__ or "").strip(), "",
                  "| flag | YAML key | default | what it does | jobs |", "|---|---|---|---|---|"]
        for name, field in section.model_fields.items():
            default = field.default_factory() if field.default_factory is not None else field.default
            lines.append(f"| `{_flag(name, field.annotation)}` | `{name}` | `{_cell(_text(default))}` | "
                         f"{_cell(field.description or '')} | {_jobs_of(name)} |")
        lines.append("")
    return lines


def reference() -> str:
    parts = [HEADER, *_train(), *_tune(),
             *_evaluate_or_predict("evaluate", cli._evaluate_flags(), "python jobs/evaluate.py (--model FILE | "
                                   "--checkpoint DIR | --run DIR) [FLAGS]",
                                   "Score a trained model on its validation rows (or other data) in a plain process; "
                                   "prints the metrics and writes them to eval.json."),
             *_evaluate_or_predict("predict", cli._predict_flags(), "python jobs/predict.py (--model FILE | "
                                   "--checkpoint DIR | --run DIR) --output DIR [FLAGS]",
                                   "Predict on a dataset (Ray Data and a pool of actors holding the model, or this "
                                   "process with `--backend local`); one parquet row out per row in, in order."),
             *_benchmark(), *_config()]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str]) -> None:
    text = reference()
    if "--write" in argv:
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(text)
        print(f"wrote {REFERENCE}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main(sys.argv[1:])
