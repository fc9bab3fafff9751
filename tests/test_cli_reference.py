"""docs/reference/cli.md is what `python -m app.cli_reference` generates, and names exactly the flags that each of the
five jobs (train, tune, evaluate, predict, and benchmark's every suite) shows in its own `--help`.

The helps are printed in this process, by the parsers the scripts call (no TensorFlow, no Ray: cheap)."""

from __future__ import annotations

import re

import pytest

from app import cli
from app.bench import flags as bench_flags
from app.bench import suites
from app.cli_reference import JOBS, REFERENCE, reference

FLAG = r"--[a-z][a-z0-9-]*"


def test_the_cli_reference_is_not_stale():
    assert REFERENCE.read_text() == reference(), "docs/reference/cli.md is stale: python -m app.cli_reference --write"


def sections() -> dict[str, str]:
    """The reference's text under each '## ' heading."""
    parts = re.split(r"^## ", REFERENCE.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def table_flags(text: str) -> set[str]:
    """Every flag named in the first cell of a table row: `--x`, `--x, --no-x`, `--x METAVAR`."""
    cells = re.findall(r"^\| `([^`]+)`", text, re.M)
    return {flag for cell in cells for flag in re.findall(rf"(?<![\w-])({FLAG})", cell)}


def documented(job: str) -> set[str]:
    """What the reference says `job` takes: its own tables, plus the configuration flags whose jobs name it."""
    own = sections()[f"jobs/{job}.py"]
    if job in ("tune",):  # its table of refused flags is not what it takes
        own = own.split("except these")[0]
    config = {flag for row in re.findall(r"^\| `.*$", sections()["Configuration flags"], re.M)
              if job in row.rsplit("|", 2)[-2] for flag in table_flags(row)}
    return table_flags(own) | config


def tyro_help(capsys, monkeypatch, parse) -> set[str]:
    """The flags a tyro --help lists, each where an argument's line starts (one column: 100 wide)."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as stop:
        parse(["--help"])
    assert stop.value.code in (0, None)
    starts = []
    for line in capsys.readouterr().out.splitlines():
        # An argument's line: the flag(s), a metavar (FILE, {a,b}, COLUMN [COLUMN ...]), then its help or nothing;
        # not a description that starts with a flag ("--devices (--backend local only)"). Boxes of │ on a
        # terminal, plain text here.
        line = line.strip("│ \n").rstrip("│").rstrip()
        found = re.match(rf"({FLAG}(?:, {FLAG})?)(?: [A-Z{{][^ ]*(?: \[[^\]]*\])?)?(?: {{2,}}|$)", line)
        starts += found.group(1).split(", ") if found else []
    return set(starts) - {"--help"}


@pytest.mark.parametrize("job", ["train", "tune", "evaluate", "predict"])
def test_the_reference_names_exactly_the_flags_of_each_jobs_help(job, capsys, monkeypatch):
    parse = {"train": cli.train_args, "tune": cli.tune_args, "evaluate": cli.evaluate_args,
             "predict": cli.predict_args}[job]
    helped = tyro_help(capsys, monkeypatch, lambda argv: parse("", argv))
    assert len(helped) > 20
    assert documented(job) == helped, (sorted(documented(job) - helped), sorted(helped - documented(job)))


def test_the_reference_names_exactly_the_flags_of_every_benchmark_suite(capsys):
    text = sections()["jobs/benchmark.py"]
    common, *per_suite = re.split(r"^### ", text, flags=re.M)
    assert [part.split("\n", 1)[0].strip() for part in per_suite] == list(suites.SUITES)
    for suite, part in zip(suites.SUITES, per_suite):
        with pytest.raises(SystemExit):
            bench_flags.parse([suite, "--help"])
        helped = set(re.findall(rf"^\s+(?:-h, )?({FLAG})", capsys.readouterr().out, re.M)) - {"--help"}
        assert table_flags(common) | table_flags(part) == helped, suite


def test_the_train_flags_that_tune_does_not_take_are_refused_in_one_line(capsys):
    refused = re.findall(rf"^\| `({FLAG})` \|", sections()["jobs/tune.py"].split("except these")[1], re.M)
    assert refused == [f"--{name.replace('_', '-')}" for name in cli.NOT_FOR_TUNE]
    for flag in refused:
        with pytest.raises(SystemExit) as stop:
            cli.tune_args("", ["--space", "tune_spaces/smoke.yaml", flag, "x"])
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: {flag} is not a sweep flag: ")


def test_the_reference_covers_the_five_jobs():
    assert JOBS == ("train", "tune", "evaluate", "predict", "benchmark")
    assert [f"jobs/{job}.py" for job in JOBS] == [name for name in sections() if name.startswith("jobs/")]
