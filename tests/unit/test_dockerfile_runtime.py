"""What the image runs, checked statically (no Docker daemon needed).

The default command is the ``kvfleet`` console script of pyproject and parses with the CLI; the
image runs as a non-root user whose group is the fsGroup of the pods that mount a volume; every
container in k8s/ runs the one image k8s/README.md tells you to build (``docker build -t``).
A negative test shows the command check reports an unknown script or module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from configs import load_config
from kvfleet.cli import build_parser
from tests.unit.dockerfile_checks import (
    _dockerfile,
    _pyproject,
    build_commands,
    command_problems,
    default_command,
    flag_values,
    manifest_images,
)
from tests.unit.dockerfile_reader import K8S_DIR, K8S_README, parse_dockerfile, words

# ---------------------------------------------------------------------------------------------
# The Dockerfile as it is


def test_default_command_is_the_kvfleet_console_script() -> None:
    argv = default_command(_dockerfile())
    assert command_problems(argv, _pyproject()) == []
    assert argv[0] == "kvfleet"
    assert not [ins for ins in parse_dockerfile(_dockerfile()) if ins.keyword == "ENTRYPOINT"], (
        "KubeRay replaces the container command with `ray start`: keep the default in CMD only"
    )


def test_default_command_parses_and_serves_on_all_interfaces() -> None:
    argv = default_command(_dockerfile())
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"
    config = load_config(args.config, args.overrides)
    assert config.serve.host == "0.0.0.0", "a container must bind all interfaces to be reachable"
    exposed = {
        int(p.split("/")[0])
        for ins in parse_dockerfile(_dockerfile())
        if ins.keyword == "EXPOSE"
        for p in words(ins.value)
    }
    assert {config.serve.port, 8265, 6379} <= exposed


def test_image_runs_as_a_non_root_user_that_can_write_the_data_volume() -> None:
    users = [ins for ins in parse_dockerfile(_dockerfile()) if ins.keyword == "USER"]
    assert users, "run as a non-root user"
    uid, _, gid = users[-1].value.partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric uid lets Kubernetes check runAsNonRoot"
    gid = gid or uid
    heads_with_claims = 0
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for pod_spec in _pod_specs(doc):
                if any("persistentVolumeClaim" in v for v in pod_spec.get("volumes", [])):
                    heads_with_claims += 1
                    assert str(pod_spec.get("securityContext", {}).get("fsGroup")) == gid, (
                        f"{path.name}: a pod mounting a volume needs securityContext.fsGroup {gid}"
                    )
    assert heads_with_claims, "no pod in k8s/ mounts a PersistentVolumeClaim"


def _pod_specs(node: Any) -> list[dict[str, Any]]:
    """Every pod spec (a mapping with `containers`) inside a manifest."""
    if isinstance(node, dict):
        found = [node] if isinstance(node.get("containers"), list) else []
        return found + [s for v in node.values() for s in _pod_specs(v)]
    if isinstance(node, list):
        return [s for v in node for s in _pod_specs(v)]
    return []


def test_k8s_manifests_run_the_image_the_readme_builds() -> None:
    builds = [cmd for cmd in build_commands(K8S_README.read_text()) if cmd[-1] == "."]
    assert builds, "k8s/README.md should show `docker build -t <image> .`"
    tags = {tag for cmd in builds for tag in flag_values(cmd, "-t")}
    assert len(tags) == 1, f"one image name in the README's docker build lines: {tags}"
    images = manifest_images()
    assert images, "no container in k8s/"
    assert set(images) == tags, f"k8s/ runs {images}, the README builds {tags}"
    assert {"raycluster.yaml", "rayjob.yaml", "rayservice.yaml"} <= images[next(iter(tags))]


# ---------------------------------------------------------------------------------------------
# The checks catch errors


def test_command_check_catches_an_unknown_script_or_module(tmp_path: Path) -> None:
    pyproject = {"project": {"scripts": {"tool": "pkg.cli:main"}}}
    assert command_problems(["kvfleet", "serve"], pyproject)  # not a script of this pyproject
    assert any("no pkg/cli.py" in p for p in command_problems(["tool"], pyproject, tmp_path))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "cli.py").write_text("def other():\n    pass\n")
    assert any("defines no main()" in p for p in command_problems(["tool"], pyproject, tmp_path))
    (tmp_path / "pkg" / "cli.py").write_text("def main():\n    pass\n")
    assert command_problems(["tool"], pyproject, tmp_path) == []
    assert command_problems([], pyproject) == ["no CMD or ENTRYPOINT"]
