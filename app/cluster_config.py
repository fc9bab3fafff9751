"""Check a Ray cluster-launcher config (cluster*.yaml) offline, with the code `ray up` runs.

`ray up` has no dry run. Before it touches the cloud it does (Ray 2.60,
ray/autoscaler/_private/commands.py, create_or_update_cluster -> _bootstrap_config):

    config = yaml.safe_load(file)
    config = prepare_config(config)    # merge the provider's defaults.yaml, node-type min/max defaults
    config = provider.fillout_available_node_types_resources(config)  # AWS: asks EC2 for CPUs/GPUs
    validate_config(config)            # ray-schema.json, head_node_type, sum of min_workers <= max_workers
    provider.bootstrap_config(config)  # AWS: IAM role, key pair, security group, subnets

This runs the two offline steps, prepare_config and validate_config, and refuses
two mistakes that Ray lets through without a word:

- a node type whose min_workers is above its max_workers (the autoscaler quietly
  keeps min(min_workers, max_workers) of it);
- a top-level min_workers on a cloud provider (fillout_defaults drops it: only the
  node types' min_workers count there).

It also refuses what the shipped files leave for the user to fill in (PLACEHOLDERS:
ami-REPLACE-ME, HEAD_IP, ...), naming the file's line: Ray would accept them, and `ray up`
would fail only later, in EC2 or in SSH.

Both Ray functions live in a private module: app.internals reaches them (one
more reason Ray is pinned in pyproject.toml), and tests/test_internals.py checks
that `ray up` still runs them.

    python -m app.cluster_config cluster.yaml cluster_ssh.yaml
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from app import internals
from app.errors import UserError


class ClusterConfigError(UserError):
    """A cluster config that `ray up` would refuse, or would run differently from what it says."""


# Values in the shipped cluster*.yaml that only say "put yours here" (tests/test_cluster_config.py checks that
# these are all the markers the shipped files use, and that each is refused).
PLACEHOLDERS = ("REPLACE-ME", "HEAD_IP", "WORKER_IP_<n>", "SSH_USER")
# ... as whole words: a start command's $RAY_HEAD_IP is Ray's variable, not a placeholder.
_PLACEHOLDER = re.compile(r"REPLACE-ME|(?<![\w$])(?:HEAD_IP|WORKER_IP_\d+|SSH_USER)(?!\w)")


def placeholders(text: str) -> list[tuple[int, str, str]]:
    """(line, key path, value) of every scalar value of the YAML text that still holds a placeholder."""
    found: list[tuple[int, str, str]] = []

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                walk(value, f"{path}.{key.value}" if path else str(key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}[{i}]")
        elif isinstance(node, yaml.ScalarNode) and _PLACEHOLDER.search(node.value):
            found.append((node.start_mark.line + 1, path, node.value))

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return found


def load_cluster_config(path: str | Path) -> dict[str, Any]:
    """Read the file the way `ray up` does (yaml.safe_load)."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ClusterConfigError(f"{path}: cannot read it: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ClusterConfigError(f"{path}: expected a mapping of config keys, got {type(config).__name__}")
    return config


def check_cluster_config(config: dict[str, Any], source: str = "cluster config") -> dict[str, Any]:
    """Return the config as `ray up` would complete it, or raise ClusterConfigError naming the problem."""
    import click
    import jsonschema

    raw = copy.deepcopy(config)
    provider = raw.get("provider")
    if not isinstance(provider, dict) or not provider.get("type"):
        raise ClusterConfigError(f"{source}: provider.type is missing (e.g. provider: {{type: aws, region: us-west-2}})")

    try:
        prepared = internals.ray_up_prepare_config(copy.deepcopy(raw))
        if provider["type"] == "aws":
            # `ray up` fills a missing `resources` from EC2 before validating; offline, start
            # from what that fill starts from. (Our configs always state `resources`.)
            for node_type in prepared.get("available_node_types", {}).values():
                if isinstance(node_type, dict):
                    node_type.setdefault("resources", {})
        internals.ray_up_validate_config(prepared)
    except jsonschema.ValidationError as e:
        where = "/".join(str(part) for part in e.absolute_path) or "top level"
        raise ClusterConfigError(f"{source}: {where}: {e.message}") from None
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError, NotImplementedError, RuntimeError,
            click.ClickException) as e:
        message = e.format_message() if isinstance(e, click.ClickException) else str(e)
        raise ClusterConfigError(f"{source}: {' '.join(message.split()) or type(e).__name__}") from None

    legacy = "available_node_types" not in raw and ("head_node" in raw or "worker_nodes" in raw)
    if provider["type"] != "local" and "min_workers" in raw and not legacy:
        raise ClusterConfigError(
            f"{source}: top-level min_workers ({raw['min_workers']}) is ignored by Ray for provider "
            f"{provider['type']!r}: set min_workers on a node type in available_node_types"
        )
    top_min, top_max = raw.get("min_workers"), raw.get("max_workers")
    if isinstance(top_min, int) and isinstance(top_max, int) and top_min > top_max:
        raise ClusterConfigError(f"{source}: min_workers ({top_min}) is above max_workers ({top_max})")
    for name, node_type in prepared["available_node_types"].items():
        low, high = node_type["min_workers"], node_type["max_workers"]
        if low > high:
            raise ClusterConfigError(
                f"{source}: available_node_types/{name}: min_workers ({low}) is above max_workers ({high}); "
                f"Ray would quietly keep only {high}"
            )
    return prepared


def check_cluster_config_file(path: str | Path) -> dict[str, Any]:
    """check_cluster_config on the file, after refusing any placeholder left in it, each by its line."""
    config = load_cluster_config(path)
    left = placeholders(Path(path).read_text())
    if left:
        raise ClusterConfigError("\n".join(
            f"{path}:{line}: {key} is still the placeholder {value!r}: put yours there (the lines marked CHANGE)"
            for line, key, value in left))
    return check_cluster_config(config, source=str(path))


def describe(config: dict[str, Any]) -> str:
    """One line: provider, head type, and each worker type's min..max."""
    head = config["head_node_type"]
    types = config["available_node_types"]
    # provider: local has a single node type, for the head and the workers alike.
    workers = [f"{name} {spec['min_workers']}..{spec['max_workers']}" for name, spec in types.items()
               if name != head or len(types) == 1]
    return f"{config['provider']['type']}, head {head}, workers {', '.join(workers)} (max_workers {config['max_workers']})"


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m app.cluster_config CLUSTER_YAML...", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            config = check_cluster_config_file(path)
        except ClusterConfigError as e:
            for line in str(e).splitlines():  # one per placeholder left
                print(f"error: {line}", file=sys.stderr)
            status = 2
        else:
            print(f"{path}: ok: {describe(config)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
