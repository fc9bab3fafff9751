"""The README's two commands are the ones CI and users run."""

from conftest import REPO


def readme_commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    return [line.strip() for line in lines if line.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command_verbatim():
    install_and_run, install_and_test = readme_commands()[:2]
    assert install_and_run.endswith("python jobs/train.py")
    assert install_and_test.endswith("python -m pytest")
    assert install_and_test in (REPO / ".ci" / "run").read_text()
