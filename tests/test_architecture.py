"""The house rules, checked on the source: imports only point down (no cycle, lazy imports included),
no module in app/ over 400 lines and no function over 80, every job script at most 80 lines, no library's private
module imported outside app/internals/."""

from __future__ import annotations

import ast
import re
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
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            # `from app import errors` imports the module app.errors, not what app/__init__.py defines.
            names = submodules if all(s in known for s in submodules) else [node.module, *submodules]
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


# The rooms of app/, bottom to top: a module imports from its own room and the rooms below it, never above
# (docs/design.md draws them). `app` itself is the public API (app/__init__.py), on top.
LAYERS = [
    {"app.errors", "app.internals", "app.tf_import", "app.layers", "app.config_scale"},
    {"app.registry", "app.config_sections", "app.models", "app.cli_errors"},
    {"app.config", "app.cluster_config"},
    {"app.backend"},
    {"app.data"},
    {"app.training"},
    {"app.ui"},
    {"app.driver"},
    {"app.backends"},
    {"app.tools"},
    {"app.run"},
    {"app.bench", "app.cli", "app"},
    {"app.cli_reference"},  # the reference of every job's flags reads the CLI's and the benchmarks' parsers
]


def room(module: str) -> str:
    """A module's room: its package under app/ (app.run.api -> app.run), or the module itself at the top level."""
    return ".".join(module.split(".")[:2])


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                  if room(a) != room(b) and level[room(b)] >= level[room(a)])


def test_imports_point_down_the_rooms():
    graph = app_graph()
    assert not {room(m) for m in graph} - set().union(*LAYERS), "a room that LAYERS does not place"
    assert not imports_up(graph), "imports that point up or sideways:\n" + "\n".join(imports_up(graph))


def test_the_direction_check_finds_an_import_that_points_up():
    assert imports_up({"app.data.memory": {"app.training.model", "app.errors"}, "app.errors": set()}) == [
        "app.data.memory -> app.training.model"]
    assert imports_up({"app.cli": {"app.bench.suites"}}) == ["app.cli -> app.bench.suites"]


# Every backend and strategy name: comparing one of them (`config.strategy == "parameter-server"`,
# `backend in ("ray", "local")`) decides a backend's behaviour, which app/backend.py does once.
BACKEND_NAMES = {"ray", "local", "parameter-server", "auto", "mirrored", "tpu", "one-device", "central-storage",
                 "pipeline"}
NAMED_HERE = {"app/backend.py", "app/config.py", "app/cli.py"}  # the choice, the cross-field rules, the CLI


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _named(node: ast.AST) -> str:
    return getattr(node, "attr", getattr(node, "id", ""))


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comparison of a backend or strategy name: with a field or variable called backend
    or strategy, or with a name that is nothing but a backend's ("parameter-server", "one-device", ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = set().union(*(_strings(s) for s in sides)) & BACKEND_NAMES
        about_backend = any(_named(s) in ("backend", "strategy") for s in sides)
        if names and (about_backend or names - {"auto", "local", "ray"}):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_backend_and_strategy_names_are_compared_in_three_modules():
    compared = {}
    for path in [*APP.rglob("*.py"), *(REPO / "jobs").glob("*.py")]:
        rel = str(path.relative_to(REPO))
        if rel not in NAMED_HERE and (found := name_comparisons(path.read_text())):
            compared[rel] = found
    assert not compared, f"backend or strategy names compared outside {sorted(NAMED_HERE)} (ask app.backend): {compared}"
    assert all(name_comparisons((REPO / rel).read_text()) for rel in NAMED_HERE - {"app/cli.py"})


def test_the_name_check_finds_a_comparison_of_a_backend_name():
    assert name_comparisons('if config.backend == "local": pass') == [(1, "config.backend == 'local'")]
    assert name_comparisons('ok = s in ("parameter-server", "pipeline")') != []
    assert name_comparisons('if task == "auto" or fmt != "local": pass') == []


def test_modules_stay_small():
    too_big = {str(p.relative_to(REPO)): n for p in APP.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not too_big
    jobs = {str(p.relative_to(REPO)): n for p in (REPO / "jobs").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 80}
    assert not jobs


def test_functions_stay_short():
    """A function of app/ is at most 80 lines (its signature and docstring included): one that grows past it holds
    several concepts, each a function of its own (a class built inside a function counts as the function's)."""
    long = [f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in APP.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


# A library's private module: a dotted segment starting with "_" (ray._private, ray.train._internal,
# tyro._errors; not a dunder such as __future__), or a tree its library keeps private.
_PRIVATE_SEGMENT = re.compile(r"^_(?!_.*__$)")
_PRIVATE_TREES = ("keras.src", "tensorflow.python", "tf_keras.src")
INTERNALS = APP / "internals"  # a package: every module in it may hold them


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, name) of each import of a library's private module or name: statements, lazy ones, importlib calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        private = [name for name in names if name.split(".")[0] != "app" and (  # our own names are ours to use
            any(_PRIVATE_SEGMENT.match(part) for part in name.split("."))
            or any(name == tree or name.startswith(tree + ".") for tree in _PRIVATE_TREES))]
        if private:
            found.append((node.lineno, private[0]))
    return found


def test_no_private_module_of_a_library_is_imported_outside_app_internals():
    found = [f"{p.relative_to(REPO)}:{line}: {name}" for p in sorted(APP.rglob("*.py")) if INTERNALS not in p.parents
             for line, name in private_imports(p.read_text())]
    assert not found, "private imports belong in app/internals/:\n" + "\n".join(found)


def test_the_private_import_finder_finds_each_kind():
    source = (
        "from __future__ import annotations\nimport ray.util\nfrom app.training.step import _sums\n"
        "import ray._private.worker\nfrom ray.train._internal.utils import get_address_and_port\n"
        "from tyro import _errors\nfrom keras.src.models.functional import Functional\n"
        "def f():\n    import tensorflow.python.ops\n    importlib.import_module('ray._common.network_utils')\n"
    )
    assert [name for _, name in sorted(private_imports(source))] == [
        "ray._private.worker", "ray.train._internal.utils", "tyro._errors",
        "keras.src.models.functional", "tensorflow.python.ops", "ray._common.network_utils"]
    assert len(private_imports((INTERNALS / "__init__.py").read_text())) >= 4  # the one place allowed to hold them
    assert len(private_imports((INTERNALS / "replicas.py").read_text())) >= 1


def test_app_internals_is_a_leaf_that_imports_libraries_only_inside_functions():
    for module in INTERNALS.glob("*.py"):
        tree = ast.parse(module.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert {a.name for n in top for a in n.names} <= {"annotations", "sys", "typing", "Any", "Callable", "Optional"}
        assert not imports_of(module, set(app_graph()))


def test_every_markdown_file_the_repository_cites_is_in_it():
    """The repository stands alone: a comment or doc names a file that is here (docs/design.md), not notes elsewhere."""
    sources = [*APP.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "jobs").glob("*.py"),
               *(REPO / "docs").rglob("*.md"), *REPO.glob("*.md"), REPO / "pyproject.toml"]
    missing = [f"{path.relative_to(REPO)}:{i}: {name}"
               for path in sources for i, line in enumerate(path.read_text().splitlines(), 1)
               for name in re.findall(r"[\w./-]*\w\.md\b", line)
               if not (REPO / name).exists() and not (path.parent / name).exists()]
    assert not missing, "\n".join(missing)


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
