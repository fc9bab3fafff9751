"""The house rules, checked on the source: imports only point down (no cycle, lazy imports included),
no module in app/ over 400 lines, every job script at most 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

APP = REPO / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every app module this file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found


def app_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in APP.rglob("*.py")}
    known = set(files)
    return {name: imports_of(path, known) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_app_lazy_imports_included():
    graph = app_graph()
    # The package itself is the top of the house: its lazy API imports point down into it.
    graph.pop("app", None)
    assert len(graph) > 20
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_modules_stay_small():
    too_big = {str(p.relative_to(REPO)): n for p in APP.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not too_big
    jobs = {str(p.relative_to(REPO)): n for p in (REPO / "jobs").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 80}
    assert not jobs


def epoch_loops(path: Path) -> list[int]:
    """Lines of the ``for epoch in ...`` loops in a file: a loop over epochs, whatever it iterates."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name)
            and node.target.id == "epoch"]


def test_one_training_loop_for_every_strategy():
    """One epoch loop (train_worker's) and one epoch record (the epoch driver's) for every backend and strategy:
    a strategy that schedules its steps otherwise (parameter servers) plugs in as a session and a step runner."""
    files = [p for folder in ("training", "run") for p in (APP / folder).rglob("*.py")]
    loops = {str(p.relative_to(REPO)): lines for p in files if (lines := epoch_loops(p))}
    assert loops == {"app/training/worker.py": loops.get("app/training/worker.py")}, loops
    assert len(loops["app/training/worker.py"]) == 1, loops
    records = [str(p.relative_to(REPO)) for p in files if "epoch_metrics(" in p.read_text()]
    assert sorted(records) == ["app/training/loop.py", "app/training/metrics.py"], records
