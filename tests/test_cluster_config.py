"""Every shipped cluster*.yaml passes the checks `ray up` runs before it touches a cloud, offline.

Ray's own functions do the work (ray.autoscaler._private.util.prepare_config, then
validate_config, as ray/autoscaler/_private/commands.py:_bootstrap_config does);
app.cluster_config adds the min_workers <= max_workers checks that Ray skips, and refuses the placeholders the shipped
files leave for the user, by line. No Ray is started and nothing talks to AWS.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
from ray.autoscaler._private.util import prepare_config, validate_config

from app.cluster_config import ClusterConfigError, check_cluster_config, load_cluster_config, main, placeholders
from conftest import REPO

SHIPPED = sorted(REPO.glob("cluster*.yaml"))

# What a user puts in place of each placeholder of the shipped files.
FILLED_IN = {"ami-REPLACE-ME": "ami-0123456789abcdef0", "~/.ssh/REPLACE-ME": "~/.ssh/id_ed25519",
             "head_ip: HEAD_IP": "head_ip: 10.0.0.1", "- WORKER_IP_1": "- 10.0.0.2", "- WORKER_IP_2": "- 10.0.0.3",
             "ssh_user: SSH_USER": "ssh_user: ubuntu"}


def filled_in(path, tmp_path):
    text = path.read_text()
    for placeholder, value in FILLED_IN.items():
        text = text.replace(placeholder, value)
    copy_ = tmp_path / path.name
    copy_.write_text(text)
    return copy_


def shipped(name: str) -> dict:
    return load_cluster_config(REPO / name)


def test_the_configs_the_readme_names_are_shipped():
    assert {"cluster.yaml", "cluster_ssh.yaml"} <= {p.name for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_passes_ray_up_checks(path):
    raw = load_cluster_config(path)
    # Ray's own steps, exactly as `ray up` runs them (minus the provider calls) ...
    validate_config(prepare_config(copy.deepcopy(raw)))
    # ... and ours on top.
    prepared = check_cluster_config(raw, source=path.name)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_keeps_auth_on_and_the_dashboard_private(path):
    text = path.read_text()
    config = check_cluster_config(load_cluster_config(path), source=path.name)
    assert "RAY_AUTH_MODE=disabled" not in text
    assert not re.search(r"dashboard-host[= ]+(0\.0\.0\.0|::)", text)
    # The token reaches every node at the path Ray reads by default, and Ray starts in token mode.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head_start = " ; ".join(config["head_start_ray_commands"])
    worker_start = " ; ".join(config["worker_start_ray_commands"])
    for start in (head_start, worker_start):
        assert "RAY_AUTH_MODE=token" in start
        assert "ray-tf-train-venv/bin" in start  # a job's python is the head's: the project's venv
    assert "--dashboard-host=127.0.0.1" in head_start
    # Setup installs this project with the CUDA build of TensorFlow (pins from pyproject.toml).
    assert any('pip install -q -e ".[gpu]"' in cmd for cmd in config["setup_commands"])
    # No credentials in the file.
    assert "BEGIN" not in text and not re.search(r"(?i)aws_(secret|access_key|session_token)", text)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_is_valid_against_rays_own_schema_file(path):
    """The JSON schema the autoscaler ships (the one validate_config reads), on what `ray up` validates: the file
    after prepare_config (for provider local it moves the top-level min_workers, which the schema does not
    take, into the node type it makes)."""
    import json

    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    raw = load_cluster_config(path)
    jsonschema.validate(prepare_config(copy.deepcopy(raw)), schema)
    if raw["provider"]["type"] == "aws":
        jsonschema.validate(raw, schema)  # the AWS file is valid as written, too


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_placeholders_are_refused_each_by_its_line_and_a_filled_in_copy_is_accepted(path, tmp_path, capsys):
    lines = path.read_text().splitlines()
    assert main([str(path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors and all(e.startswith(f"error: {path}:") for e in errors), errors
    for error in errors:  # the line it names holds the placeholder it quotes
        line, value = re.match(rf"error: {re.escape(str(path))}:(\d+): .* placeholder '([^']+)'", error).groups()
        assert value in lines[int(line) - 1], (error, lines[int(line) - 1])
    assert len(errors) == sum(line.split("#")[0].count(marker) for line in lines for marker in FILLED_IN)

    assert main([str(filled_in(path, tmp_path))]) == 0
    assert f"\n{tmp_path / path.name}: ok: " in "\n" + capsys.readouterr().out  # (after Ray's own warnings)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_value_that_looks_like_a_placeholder_is_one_that_is_refused(path):
    """A new marker in a shipped file (ACCOUNT_ID, <bucket>, ...) must be one app.cluster_config refuses."""
    refused = {value for _, _, value in placeholders(path.read_text())}

    def values(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                if not str(k).endswith("_commands"):  # shell: $RAY_HEAD_IP, PATH=... are the shell's
                    yield from values(v, str(k))
        elif isinstance(node, list):
            for item in node:
                yield from values(item, key)
        elif isinstance(node, str):
            yield node

    looks = {v for v in values(load_cluster_config(path))
             if re.search(r"REPLACE|TODO|<[^>]+>|^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$", v)}
    assert looks and looks == refused, (looks, refused)


def test_aws_config_has_an_autoscaling_gpu_worker_type():
    config = check_cluster_config(shipped("cluster.yaml"))
    assert config["provider"]["type"] == "aws"
    head = config["available_node_types"][config["head_node_type"]]
    assert "GPU" not in head["resources"]
    gpu = config["available_node_types"]["ray.worker.gpu"]
    assert gpu["node_config"]["InstanceType"].startswith("g5.")
    # Rank 0 writes checkpoints to --storage-path s3://... from a worker: the workers get an instance profile.
    assert gpu["node_config"]["IamInstanceProfile"] == {"Name": "ray-autoscaler-v1"}
    assert gpu["resources"]["GPU"] >= 1
    assert gpu["min_workers"] < gpu["max_workers"] <= config["max_workers"]


# --- broken configs --------------------------------------------------------------


def test_unknown_top_level_key_is_refused_by_ray_itself():
    broken = shipped("cluster.yaml") | {"max_worker": 8}  # a typo of max_workers
    with pytest.raises(jsonschema.ValidationError, match="'max_worker' was unexpected"):
        validate_config(prepare_config(broken))
    with pytest.raises(ClusterConfigError, match="'max_worker' was unexpected"):
        check_cluster_config(broken)


def test_unknown_node_type_key_is_refused():
    broken = shipped("cluster.yaml")
    broken["available_node_types"]["ray.worker.gpu"]["min_worker"] = 1  # a typo of min_workers
    with pytest.raises(ClusterConfigError, match=r"available_node_types/ray\.worker\.gpu: .*'min_worker' was unexpected"):
        check_cluster_config(broken)


def test_more_min_workers_than_the_cluster_max_workers_is_refused_by_ray_itself():
    broken = shipped("cluster.yaml")
    broken["available_node_types"]["ray.worker.gpu"].update(min_workers=5, max_workers=8)
    broken["max_workers"] = 4
    with pytest.raises(ValueError, match="global `max_workers` is smaller than the sum of `min_workers`"):
        validate_config(prepare_config(broken))
    with pytest.raises(ClusterConfigError, match="smaller than the sum of `min_workers`"):
        check_cluster_config(broken)


def test_node_type_min_workers_above_its_max_workers_is_refused():
    broken = shipped("cluster.yaml")
    broken["available_node_types"]["ray.worker.gpu"].update(min_workers=3, max_workers=2)
    # Ray 2.60 lets this through (the autoscaler quietly keeps min(min, max) nodes) ...
    validate_config(prepare_config(broken))
    # ... so our check refuses it.
    with pytest.raises(ClusterConfigError, match=r"ray\.worker\.gpu: min_workers \(3\) is above max_workers \(2\)"):
        check_cluster_config(broken)


def test_top_level_min_workers_on_aws_is_refused_because_ray_drops_it():
    broken = shipped("cluster.yaml") | {"min_workers": 2}
    assert "min_workers" not in prepare_config(broken)  # dropped without a word
    with pytest.raises(ClusterConfigError, match="top-level min_workers .* is ignored"):
        check_cluster_config(broken)


def test_ssh_cluster_min_workers_above_max_workers_is_refused():
    broken = shipped("cluster_ssh.yaml")
    broken["provider"]["worker_ips"] = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
    broken.update(min_workers=3, max_workers=2)
    with pytest.raises(ClusterConfigError, match="min_workers"):
        check_cluster_config(broken)


def test_missing_provider_is_refused():
    broken = shipped("cluster.yaml")
    del broken["provider"]
    with pytest.raises(ClusterConfigError, match="provider.type is missing"):
        check_cluster_config(broken)


def test_command_line_names_the_problem(tmp_path, capsys):
    bad = tmp_path / "cluster_bad.yaml"
    bad.write_text((REPO / "cluster.yaml").read_text() + "\nmax_worker: 8\n")
    assert main([str(filled_in(REPO / "cluster.yaml", tmp_path)), str(filled_in(REPO / "cluster_ssh.yaml", tmp_path))]) == 0
    bad.write_text(filled_in(REPO / "cluster.yaml", tmp_path).read_text() + "\nmax_worker: 8\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cluster_bad.yaml: top level: Additional properties are not allowed ('max_worker' was unexpected)" in err
