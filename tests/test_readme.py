"""The README's and the guides' commands: the two that CI and users run, and every other one, from the repository
root."""

import re
import sys

import pytest

from conftest import REPO


def readme_commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    return [line.strip() for line in lines if line.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command_verbatim():
    install_and_run, install_and_test = readme_commands()[:2]
    assert install_and_run.endswith("python jobs/train.py")
    assert install_and_test.endswith("python -m pytest")
    assert install_and_test in (REPO / ".ci" / "run").read_text()


def test_the_readme_is_short():
    """Five minutes for a newcomer: the rest is in docs/guides/, each guide linked from it."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    guides = sorted(p.name for p in (REPO / "docs" / "guides").glob("*.md"))
    assert guides and all(f"docs/guides/{name}" in readme for name in guides), guides


def test_every_file_flag_and_test_the_readme_names_exists():
    """A README or a guide that names a file, a flag or a test that is not there sends a user (or a reviewer)
    nowhere."""
    import re
    import subprocess
    import sys

    readme = "".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs" / "guides").glob("*.md")])
    files = set(re.findall(r"\b((?:app|jobs|tests|tune_spaces|docs|examples|\.ci)/[\w./-]*\w)", readme))
    missing_files = sorted(f for f in files if not (REPO / f).exists() and "<" not in f and "*" not in f)
    assert not missing_files, missing_files

    # Flags of our scripts, from their --help; other tools' flags (ray, pip, docker, pytest) are theirs.
    from app.bench.suites import SUITES

    commands = [["train"], ["tune"], ["evaluate"], ["predict"], *[["benchmark", suite] for suite in SUITES]]
    helps = "".join(subprocess.run([sys.executable, f"jobs/{job}.py", *rest, "--help"], cwd=REPO, capture_output=True,
                                   text=True, timeout=300).stdout for job, *rest in commands)
    ours = set(re.findall(r"(--[a-z][a-z0-9-]*)", helps))
    theirs = {"--head", "--num-cpus", "--address", "--working-dir", "--submission-id", "--port", "--block",
              "--dashboard-host", "--dashboard-port", "--temp-dir", "--no-config-cache", "--yes", "--dir",
              "--tag_set", "--signature_def", "--all", "--model_base_path", "--model_name", "--rest_api_port",
              "--durations", "--editable", "--upgrade", "--logdir", "--ray-client-server-port", "--disable-usage-stats",
              "--autoscaling-config", "--dashboard-agent-listen-port", "--help",
              "--follow", "--generate",  # ray job logs --follow, ray get-auth-token --generate
              "--tag", "--signature",  # saved_model_cli's --tag_set and --signature_def, as the pattern below cuts them
              "--role-name", "--policy-name", "--policy-document"}  # aws iam put-role-policy (the cluster guide)
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", readme))
    unknown = sorted(f for f in flags - ours - theirs if f.replace("--no-", "--") not in ours)
    assert not unknown, unknown

    # Tests named by function: each is defined in the tests.
    sources = "".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b", readme)) - {p.stem for p in (REPO / "tests").glob("test_*.py")}
    named -= {"test_step"}  # Keras's own Model.test_step, which a user's model may override
    assert not sorted(n for n in named if f"def {n}" not in sources), named


# Commands of other programs whose product-side part is checked elsewhere, and where.
ELSEWHERE = {
    'pip install -e ".[cpu]"': "tests/test_install.py (the cpu extra resolves; CI installs it with the test extra)",
    "pip install boto3": "S3's client library for --storage-path s3://, not this project's (no S3 here)",
    "docker run": "TensorFlow Serving's image (no Docker here); tests/test_export.py serves the same SavedModel "
                  "signature in a process that never imports this project",
    "curl": "the request to TensorFlow Serving above",
}


def test_every_command_of_the_readme_and_the_guides_is_run_by_a_test_or_an_example():
    """A command a reader copies runs somewhere in the default test run: jobs/train.py's as dry runs
    (tests/test_your_own.py::test_dry_run_prints_the_plan_for_every_readme_command, which takes the same list), the
    two commands as CI's own, and every other one's program with each of its flags in a test or an example."""
    import ast
    import re

    from conftest import doc_commands

    # What each test function or example runs (a job script, an app module, a subcommand of ray or of a tool), with
    # every flag written in that function.
    runs: dict[str, set[str]] = {}
    for path in [*(REPO / "tests").glob("test_*.py"), *(REPO / "examples").glob("*.py")]:
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                body = ast.get_source_segment(text, node)
                programs = set(re.findall(r"jobs/\w+\.py|app\.\w+", body))
                programs |= {" ".join(("ray", *(w for w in words if w))) for *words, in re.findall(
                    r'ray_cli\(\), "([a-z-]+)"(?:, "(submit|logs|status|stop)")?', body)}
                programs |= {" ".join(w for w in words if w) for *words, in re.findall(
                    r'"(saved_model_cli|tensorboard)"(?:, "([a-z_]+)")?', body)}
                for name in programs:
                    runs.setdefault(name, set()).update(re.findall(r'"(--[a-z][a-z0-9_-]*)"', body))
    ci = (REPO / ".ci" / "run").read_text()

    def program(command: str) -> str:
        words = re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", command).split()
        if words[0] == "python":
            return words[2] if words[1] == "-m" else words[1]
        if words[0] == "ray" and words[1] == "job" or words[0] == "saved_model_cli":
            return " ".join(words[:3] if words[0] == "ray" else words[:2])
        return " ".join(words[:2]) if words[0] == "ray" else words[0]

    unrun = []
    for doc, command in doc_commands():
        if command in ci or command.startswith("python jobs/train.py") or any(map(command.startswith, ELSEWHERE)):
            continue
        found = runs.get(program(command))
        flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", command)
        if found is None or not set(flags) <= found:
            unrun.append(f"{doc}: {command}" + (f" (not run with {sorted(set(flags) - found)})" if found else ""))
    assert not unrun, "commands no test or example runs:\n" + "\n".join(unrun)


# Paths in a command that are the reader's own (their data, their runs, their bucket, the head's disk): everything
# else a command names is a file of this repository, and must be there.
READERS = ("<", "...", "runs/", "data/", "preds/", "/home/", "/shared/", "s3://", "gs://", "http://", "http:")


def test_every_command_of_the_docs_runs_from_the_repository_root(monkeypatch, capsys):
    """Every `python -m app.*`, `python jobs/*.py` and `ray ...` command of the README and the guides, as a reader
    copies it into a shell at the repository root: each file it names is there, and its command line is one the
    program accepts, parsed by the program's own parser in this process (no Ray, no TensorFlow). What would train
    stops short of it: jobs/train.py's commands are dry-run by
    tests/test_your_own.py::test_dry_run_prints_the_plan_for_every_readme_command; jobs/tune.py's load their
    space and check every trial's config; `ray` commands are parsed by Ray's own click commands, not run (no
    cluster here: tests/test_ray_up.py runs them against one over SSH)."""
    import shlex

    from ray.scripts.scripts import cli as ray_cli

    from app import cli
    from app.bench import flags as bench_flags
    from app.bench import suites
    from app.tools.tune import load_space
    from conftest import doc_commands

    monkeypatch.chdir(REPO)
    parsers = {"jobs/train.py": cli.train_args, "jobs/tune.py": cli.tune_args, "jobs/evaluate.py": cli.evaluate_args,
               "jobs/predict.py": cli.predict_args}
    checked: dict[str, int] = {}  # commands checked, by program
    for doc, command in doc_commands():
        words = shlex.split(re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", command))
        if words[:2] != ["python", "-m"] and not (words[0] == "python" and words[1].startswith("jobs/")) \
                and words[0] != "ray" or words[:3] == ["python", "-m", "pytest"]:
            continue
        where = f"{doc}: {command}"
        # Every repository file it names (a path, or the file of file.py:function) is there.
        for word in words[1:]:
            path = word.split(":")[0] if re.match(r"[\w./-]+\.py:\w+$", word) else word
            if ("/" in path or re.search(r"\.(py|ya?ml)$", path)) and not any(r in path for r in READERS):
                assert (REPO / path).exists(), f"{where}: no {path} in the repository"
        if words[0] == "ray":
            argv = words[1:] + (["--", "python"] if words[1:3] == ["job", "submit"] else [])
            context = ray_cli.make_context("ray", argv, resilient_parsing=False)
            name, command_, rest = ray_cli.resolve_command(context, context.protected_args + context.args)
            while hasattr(command_, "resolve_command"):  # a group (ray job): its subcommand
                sub = command_.make_context(name, rest, parent=context)
                name, command_, rest = command_.resolve_command(sub, sub.protected_args + sub.args)
            command_.make_context(name, rest, parent=context)  # click raises on a flag or argument it does not take
        elif words[1] == "-m":
            assert words[2] == "app.cluster_config", f"{where}: a module this test does not know how to run"
            from app.cluster_config import main

            # On the file as shipped it names each placeholder left, by line (the guide quotes the first).
            assert main(words[3:]) == 2
            first = capsys.readouterr().err.splitlines()[0]
            assert "is still the placeholder" in first, first
            guide = REPO / "docs/guides/clusters-and-fault-tolerance.md"
            assert first.split(" is still")[0].removeprefix("error: ") in guide.read_text(), first
        elif words[1] == "jobs/benchmark.py":
            args = bench_flags.parse(words[2:])
            suites.load_preset(args.suite, args.preset, args.quick, bench_flags.suite_flags(args), args.config, args.set)
        else:
            with monkeypatch.context() as m:
                m.setattr(sys, "argv", words[1:])
                if "--help" in words:
                    with pytest.raises(SystemExit) as stop:
                        parsers[words[1]]("", words[2:])
                    assert stop.value.code == 0, where
                    continue
                parsed = parsers[words[1]]("", words[2:])  # a refused command line exits 2 with its one line
            if words[1] == "jobs/tune.py":
                load_space(parsed.space, parsed.fixed)
        program = "ray" if words[0] == "ray" else words[2] if words[1] == "-m" else words[1]
        checked[program] = checked.get(program, 0) + 1
    assert {"jobs/train.py", "jobs/tune.py", "jobs/evaluate.py", "jobs/predict.py", "app.cluster_config",
            "ray"} <= set(checked), checked
