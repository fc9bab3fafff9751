"""Benchmark presets: what each suite measures on, as YAML, one section per suite.

    throughput:                # the suite
      workers: auto            # the suite's own parameters (flags of jobs/benchmark.py override them)
      workload:                # TrainConfig fields: what jobs/train.py --config takes
        dataset: synthetic
        ...

The bundled presets are ``presets/full.yaml`` (the default) and
``presets/quick.yaml`` (``--quick``: small and short, checks that a suite
works). ``--preset FILE`` takes a file of the same form; a bare name (``full``)
means a bundled one. The workload is ``preset < --config FILE < --set
FIELD=VALUE``, validated as a TrainConfig before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from app.config import build_config, read_yaml
from app.errors import UserError

PRESETS = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True)
class Preset:
    suite: str
    file: str  # where it came from
    params: dict[str, Any]  # the suite's own parameters
    workload: dict[str, Any]  # TrainConfig fields, validated

    def as_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "file": self.file, **self.params, "workload": self.workload}


def preset_file(preset: Optional[str], quick: bool) -> Path:
    """The preset to read: ``--preset`` (a path, or a bundled name), else quick.yaml or full.yaml."""
    if preset is None:
        return PRESETS / ("quick.yaml" if quick else "full.yaml")
    if Path(preset).is_file():
        return Path(preset)
    bundled = PRESETS / f"{preset}.yaml"
    if bundled.is_file():
        return bundled
    names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    raise UserError(f"--preset {preset!r} is neither a file nor a bundled preset ({names})")


def parse_sets(items: Iterable[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items -> {field: value}; values read as YAML (``3``, ``[8, 16]``, ``cnn``)."""
    values = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise UserError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set epochs=3")
        try:
            values[field.strip().replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: the value is not valid YAML") from None
    return values


def load(suite: str, params: tuple[str, ...], file: Path, flags: Optional[dict[str, Any]] = None,
         config_file: Optional[str] = None, sets: Optional[dict[str, Any]] = None) -> Preset:
    """Read ``suite``'s section of ``file``; flags (not None) override its parameters, which must be ``params``."""
    section = read_yaml(file).get(suite)
    if not isinstance(section, dict):
        raise UserError(f"preset {str(file)!r} has no {suite!r} section (a mapping of its parameters and workload)")
    section = dict(section)
    workload = section.pop("workload", None) or {}
    unknown, missing = set(section) - set(params), set(params) - set(section)
    if unknown or missing:
        raise UserError(
            f"preset {str(file)!r}, section {suite!r}: "
            + "; ".join(f"{what} {', '.join(sorted(keys))}" for what, keys in
                        (("unknown key(s)", unknown), ("missing key(s)", missing)) if keys)
            + f" (its keys: {', '.join(params)}, workload)"
        )
    section.update({k: v for k, v in (flags or {}).items() if v is not None})
    # every number a suite takes is a count or a size (runs, rows, epochs, workers, seconds): none can be 0 or less
    if bad := [f"{k} {v}" for k, v in section.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and v <= 0]:
        raise UserError(f"{suite}: {', '.join(bad)}: must be above 0")
    workload = {**workload, **(read_yaml(config_file) if config_file else {}), **(sets or {})}
    build_config(None, {**workload, "output": "unused"})  # refuse a bad field or value now, in one line
    return Preset(suite, str(file), section, workload)
