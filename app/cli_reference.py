"""docs/reference/cli.md, generated from the typed config: every field of every section, as a flag and a YAML key.

    python -m app.cli_reference            # print it
    python -m app.cli_reference --write    # write docs/reference/cli.md (tests/test_cli_reference.py: not stale)

The same fields are ``jobs/train.py``'s flags, ``--config``'s YAML keys, ``app.train``'s and ``app.fit``'s
keywords, and a search space's keys (``jobs/tune.py``); the descriptions are the ones ``--help`` prints.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from app.config_sections import SECTIONS

REFERENCE = Path(__file__).resolve().parents[1] / "docs/reference/cli.md"

HEADER = """# Configuration reference

Generated from the typed config (`app/config_sections.py`) by `python -m app.cli_reference --write`;
`tests/test_cli_reference.py` fails when this file is stale. Each field is a flag of `jobs/train.py` (and of
`jobs/tune.py`, where it fixes the value for every trial), a key of a `--config` YAML file (`field_name: value`),
and a keyword of `app.train(...)` and `app.fit(...)`. `python jobs/train.py --help` prints the same, by section.

Precedence: the defaults below < `--config FILE` (with `--resume` and no `--config`: `<output>/config.yaml`) <
the flags typed.
"""


def _default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _flag(name: str, annotation: Any) -> str:
    flag = f"--{name.replace('_', '-')}"
    return f"{flag}, --no-{flag[2:]}" if annotation in (bool, Optional[bool]) else flag


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference() -> str:
    lines = [HEADER]
    for section in SECTIONS:
        title = section.__name__.removesuffix("Section")
        lines += [f"## {title}", "", (section.__doc__ or "").strip(), "",
                  "| flag | YAML key | default | what it does |", "|---|---|---|---|"]
        for name, field in section.model_fields.items():
            default = field.default_factory() if field.default_factory is not None else field.default
            lines.append(f"| `{_flag(name, field.annotation)}` | `{name}` | `{_cell(_default(default))}` | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


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
