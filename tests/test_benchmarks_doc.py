"""BENCHMARKS.md says only what a command of today's jobs/benchmark.py can reproduce: one section per suite, every
command it quotes one that jobs/benchmark.py accepts (its own parser and preset loader, in this process), and every
table with its command, its commit and its date. No Ray, no TensorFlow: cheap."""

from __future__ import annotations

import re
import shlex
import subprocess

from app.bench import flags as bench_flags
from app.bench import suites
from conftest import REPO

TEXT = (REPO / "BENCHMARKS.md").read_text()


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", TEXT, flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def quoted_commands(text: str) -> list[str]:
    """`python jobs/benchmark.py ...` as a code line (indented) or inline (in backticks)."""
    return ([line.strip() for line in text.splitlines() if line.startswith("    python jobs/benchmark.py")]
            + re.findall(r"`(python jobs/benchmark\.py[^`]*)`", text))


def test_one_section_per_suite_in_the_order_of_jobs_benchmark_py():
    assert list(sections()) == list(suites.SUITES)


def test_every_command_quoted_is_one_jobs_benchmark_py_accepts():
    commands = quoted_commands(TEXT)
    assert len(commands) >= len(suites.SUITES)
    for command in commands:
        args = bench_flags.parse(shlex.split(command)[2:])  # argparse exits 2 on a flag it does not take
        suites.load_preset(args.suite, args.preset, args.quick, bench_flags.suite_flags(args), args.config, args.set)


def test_every_table_has_its_command_commit_and_date():
    known = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True).returncode == 0
    for suite, text in sections().items():
        if "\n|---" not in text:
            continue
        commands = [c for c in quoted_commands(text) if bench_flags.parse(shlex.split(c)[2:]).suite == suite]
        assert commands, f"{suite}: no command of its own suite"
        commit = re.search(r"^Commit ([0-9a-f]{7,40}), (20\d\d-\d\d-\d\d)\b", text, re.M)
        assert commit, f"{suite}: no 'Commit <hash>, <date>' line"
        if known:  # the commit is one of this repository's (a fresh clone has the whole history)
            resolved = subprocess.run(["git", "cat-file", "-e", f"{commit.group(1)}^{{commit}}"], cwd=REPO)
            assert resolved.returncode == 0, f"{suite}: no commit {commit.group(1)}"


def test_no_development_history():
    """git keeps the history; the page says what the figures are, not how they came to be."""
    history = re.findall(r"(?i)\b(before|goals?|met|missed|found on the way|the old figure|not tried|by hand|"
                         r"scratch|tried and|no longer|used to)\b", TEXT)
    assert not history, history
