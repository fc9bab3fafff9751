"""A sweep's search space: its YAML file read into Tune's ``param_space``, and every trial's config checked before
the first trial starts.

Keys are TrainConfig field names; a value is fixed, or one Tune domain ``{grid|choice|uniform|...: [args]}``.
Every trial the space can make is validated as ``jobs/train.py`` validates a config (the cross-field rules
included): each grid point with each choice and each range's ends (and middle, where a range is continuous), so a
combination that no single value shows (a worker range its --global-batch cannot split) is refused in one line
naming the trial's values, before Ray starts.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.config import TrainConfig, build_config, read_yaml
from app.errors import UserError

# Fields a space may not set: they say where a trial writes or how it resumes.
NOT_SEARCHABLE = {"output", "overwrite", "resume", "storage_path", "backend", "strategy", "devices"}
# Trials checked one by one up to this many combinations; past it, each value with the others' first values.
MAX_CHECKED = 4096


def _domains() -> dict[str, Any]:
    from ray import tune

    return {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": tune.uniform,
        "quniform": tune.quniform,
        "loguniform": tune.loguniform,
        "qloguniform": tune.qloguniform,
        "randint": tune.randint,
        "qrandint": tune.qrandint,
        "lograndint": tune.lograndint,
    }


def _candidates(kind: str, args: Any) -> list[Any]:
    """The values of a domain that stand for all it can give: every listed one, a range's ends (a continuous range's
    middle too: a float where an integer is wanted shows there)."""
    if kind in ("grid", "choice"):
        return list(args)
    low, high = args[0], args[1]
    if kind in ("randint", "qrandint", "lograndint"):
        return [low, high - 1]
    # A point inside, off any round number (as a sample is): an integer field refuses it, as it refuses the samples.
    inside = 0.381966
    if kind == "loguniform" and low > 0 < high:
        return [low, math.exp(math.log(low) + (math.log(high) - math.log(low)) * inside), high]
    return [low, low + (high - low) * inside, high] if kind == "uniform" else [low, high]


def load_space(path: str | Path, fixed: dict[str, Any]) -> dict[str, Any]:
    """YAML -> Tune param_space, refusing unknown keys, malformed domains and any trial whose config is invalid."""
    raw = read_yaml(path)
    domains = _domains()
    space: dict[str, Any] = {}
    candidates: dict[str, list[Any]] = {}
    for key, value in raw.items():
        if key not in TrainConfig.model_fields:
            raise UserError(f"search space {str(path)!r}: unknown key {key!r} (keys are TrainConfig fields: see "
                            "python jobs/train.py --help)")
        if key in NOT_SEARCHABLE:
            raise UserError(f"search space {str(path)!r}: {key!r} cannot be searched (it says where trials run "
                            "or write); set it with a flag")
        if key in fixed:
            raise UserError(f"{key!r} is both fixed by a flag and searched in {str(path)!r}: drop one")
        if isinstance(value, dict):
            if len(value) != 1 or next(iter(value)) not in domains:
                raise UserError(f"search space {str(path)!r}: key {key!r} has a malformed domain {value!r}: "
                                f"write {{<domain>: <args>}} with one of {', '.join(domains)}")
            kind, args = next(iter(value.items()))
            if not isinstance(args, list) or not args:
                raise UserError(f"search space {str(path)!r}: {key!r}: {kind} needs a non-empty list, got {args!r}")
            if kind not in ("grid", "choice") and len(args) < 2:
                raise UserError(f"search space {str(path)!r}: {key!r}: bad {kind} arguments {args!r}: give "
                                f"[low, high{', q' if kind.startswith('q') else ''}]")
            try:
                candidates[key] = _candidates(kind, args)
                space[key] = domains[kind](args) if kind in ("grid", "choice") else domains[kind](*args)
            except (TypeError, ValueError, IndexError) as e:
                raise UserError(f"search space {str(path)!r}: {key!r}: bad {kind} arguments {args!r} ({e})") from None
        else:
            candidates[key], space[key] = [value], value
        for candidate in candidates[key]:  # a value its field refuses is named on its own
            if (problem := _field_problem(fixed, key, candidate)) is not None:
                raise UserError(f"search space {str(path)!r}: {key!r} = {candidate!r} is invalid: {problem}")
    check_trials(path, fixed, candidates)
    return space


def check_trials(path: str | Path, fixed: dict[str, Any], candidates: dict[str, list[Any]]) -> int:
    """Every trial's config (each combination of the candidates, with the fixed flags) valid, or one line naming
    the first trial that is not; returns how many combinations were checked."""
    keys = list(candidates)
    count = math.prod(len(v) for v in candidates.values())
    if count <= MAX_CHECKED:
        combinations = (dict(zip(keys, values)) for values in itertools.product(*candidates.values()))
    else:  # too many to build one by one: each value beside the others' first
        first = {k: v[0] for k, v in candidates.items()}
        combinations = ({**first, k: value} for k in keys for value in candidates[k])
    checked = 0
    for trial in combinations:
        searched = {k: v for k, v in trial.items() if len(candidates[k]) > 1}
        named = ", ".join(f"{k}={v}" for k, v in searched.items()) or "of the fixed values"
        _check(path, fixed, trial, f"the trial {named} is invalid")
        checked += 1
    return checked


def _field_problem(fixed: dict[str, Any], key: str, value: Any) -> str | None:
    """What ``key``'s own field says against ``value`` (its type, its bounds), or None. The rules between fields are
    left to the trials' check: a value may be wrong beside the defaults and right beside the space's other values."""
    try:
        TrainConfig(**{**fixed, key: value, "output": "x"})
    except ValidationError as e:
        own = [err["msg"].removeprefix("Value error, ") for err in e.errors() if err["loc"][:1] == (key,)]
        return "; ".join(own) or None
    return None


def _check(path: str | Path, fixed: dict[str, Any], values: dict[str, Any], what: str) -> None:
    try:
        build_config(None, {**fixed, **values, "output": "x"})
    except UserError as e:
        raise UserError(f"search space {str(path)!r}: {what}: {str(e).removeprefix('invalid config: ')}") from None
