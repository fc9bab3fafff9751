"""docs/reference/cli.md is what `python -m app.cli_reference` generates from the config, and names exactly the flags
`jobs/train.py --help` takes."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO


def test_the_cli_reference_is_not_stale():
    from app.cli_reference import REFERENCE, reference

    assert REFERENCE.read_text() == reference(), "docs/reference/cli.md is stale: python -m app.cli_reference --write"


def test_the_cli_reference_names_the_flags_of_jobs_train_py():
    helped = subprocess.run([sys.executable, "jobs/train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={"COLUMNS": "200", "PATH": ""}).stdout
    documented = set(re.findall(r"^\| `([^`]+)`", (REPO / "docs/reference/cli.md").read_text(), re.M))
    flags = {flag for row in documented for flag in row.split(", ")}
    # (a flag cut at the end of a help line leaves "--synthetic-": not a flag)
    taken = {f for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", helped) if not f.endswith("-")}
    taken -= {"--help", "--config", "--dry-run"}
    assert flags == taken, (sorted(flags - taken), sorted(taken - flags))
