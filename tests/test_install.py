"""`pip install -e ".[cpu]"` on the platforms TensorFlow 2.21 ships CPU wheels for (the README's table), checked by
pip's resolver.

pip evaluates environment markers against the machine it runs on, whatever ``--platform`` says, so a dry run
from this Linux x86-64 machine with a Mac's tags would still pick the Linux requirement. What a Mac's pip would
do is done in two steps: the project's requirements with their markers evaluated for the target (``packaging``,
as pip does), then pip's resolver on them with the target's wheel tags (``--platform``, taken literally, so
every tag is listed) and only wheels (nothing to build there).
"""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement

from conftest import REPO, run_jobs_at_once

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

TARGETS = {
    "macOS arm64": (
        {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64", "os_name": "posix"},
        [f"macosx_{v}_0_arm64" for v in range(11, 15)],
    ),
    "Linux aarch64": (
        {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64", "os_name": "posix"},
        ["manylinux2014_aarch64", *(f"manylinux_2_{v}_aarch64" for v in range(17, 36))],
    ),
    "Windows x86-64": (
        {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64", "os_name": "nt"},
        ["win_amd64"],
    ),
}
# The TensorFlow each target's cpu extra installs: the CPU-only build where PyPI has it.
TENSORFLOW = {"macOS arm64": "tensorflow==2.21.0", "Linux aarch64": "tensorflow==2.21.0",
              "Windows x86-64": "tensorflow-cpu==2.21.0"}


def requirements_for(environment: dict[str, str], extra: str) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = []
    for line in project["dependencies"] + project["optional-dependencies"][extra]:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": extra}):
            requirement.marker = None
            wanted.append(str(requirement))
    return wanted


def test_the_cpu_extra_picks_the_tensorflow_each_platform_has():
    assert "tensorflow-cpu==2.21.0" in requirements_for({"sys_platform": "linux", "platform_machine": "x86_64"}, "cpu")
    assert "tensorflow-cpu==2.21.0" in requirements_for({"sys_platform": "win32", "platform_machine": "AMD64"}, "cpu")
    for name, (environment, _) in TARGETS.items():
        wanted = [r for r in requirements_for(environment, "cpu") if r.startswith("tensorflow")]
        assert wanted == [TENSORFLOW[name]], (name, wanted)
    assert not any(r.startswith("tensorflow") for r in requirements_for({"sys_platform": "darwin"}, "gpu"))


def test_pip_resolves_the_cpu_extra_for_a_mac_linux_aarch64_and_windows_and_not_the_cpu_only_build_on_a_mac(tmp_path):
    """The two resolutions, and what the markers are for (the CPU-only build has no Mac wheel: before them,
    `.[cpu]` failed there), side by side: each is mostly waiting on the package index."""
    def dry_run(tags, *requirements):
        return ["-m", "pip", "install", "--dry-run", "--quiet", "--target", str(tmp_path / "target"),
                "--only-binary=:all:", "--python-version", "3.11", *(f"--platform={tag}" for tag in tags),
                *requirements]

    commands = []
    for name, (environment, tags) in TARGETS.items():
        requirements = tmp_path / f"{name.replace(' ', '-')}.txt"
        requirements.write_text("\n".join(requirements_for(environment, "cpu")) + "\n")
        commands.append(dry_run(tags, "-r", str(requirements)))
    commands.append(dry_run(TARGETS["macOS arm64"][1], "--no-deps", "tensorflow-cpu==2.21.0"))
    *resolved, cpu_only_on_a_mac = run_jobs_at_once(*commands, timeout=600)
    for name, p in zip(TARGETS, resolved):
        if "Could not fetch URL" in p.stderr or "NewConnectionError" in p.stderr:
            pytest.fail(f"{name}: the package index is out of reach: {p.stderr[-500:]}")
        assert p.returncode == 0, f"{name}: {p.stderr[-2000:]}"
    assert cpu_only_on_a_mac.returncode != 0
    assert "No matching distribution found for tensorflow-cpu==2.21.0" in cpu_only_on_a_mac.stderr
