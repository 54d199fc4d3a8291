"""What the Dockerfile says, for the Dockerfile tests: its base image, torch install and default
command, the packages pyproject installs and the Dockerfile copies, the ``docker build`` lines of a
text and the images the containers of k8s/ run.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from tests.unit.dockerfile_reader import (
    DOCKERFILE,
    K8S_DIR,
    REPO,
    arg_defaults,
    copy_sources,
    expand,
    parse_dockerfile,
    words,
)

# ---------------------------------------------------------------------------------------------
# What the Dockerfile says


def base_image_problems(dockerfile: str) -> list[str]:
    """Why the base image is not switchable by a build argument ([] if it is)."""
    instructions = parse_dockerfile(dockerfile)
    froms = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    if not froms:
        return ["no FROM"]
    first = froms[0]
    declared = arg_defaults(instructions[:first])  # only ARGs before the first FROM reach it
    image = words(instructions[first].value)[0]
    names = re.findall(r"\$\{?(\w+)\}?", image)
    if not names:
        return [f"FROM {image}: the base image is fixed, not a build argument"]
    problems = [f"FROM {image}: ARG {n} is not declared before FROM" for n in names if n not in declared]
    if not problems and not expand(image, declared):
        problems.append(f"FROM {image}: the build argument has no default")
    return problems


def torch_install(dockerfile: str) -> tuple[str, str]:
    """(version, index URL) of the ``pip install torch==...`` step, with ARG defaults filled in."""
    instructions = parse_dockerfile(dockerfile)
    defaults = arg_defaults(instructions)
    for ins in instructions:
        if ins.keyword != "RUN" or "torch==" not in ins.value:
            continue
        argv = shlex.split(expand(ins.value, defaults))
        version = next(w.split("==", 1)[1] for w in argv if w.startswith("torch=="))
        index = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--index-url"), "")
        index = index or next((w.split("=", 1)[1] for w in argv if w.startswith("--index-url=")), "")
        return version, index
    raise AssertionError("no `pip install torch==...` step in the Dockerfile")


def default_command(dockerfile: str) -> list[str]:
    """The argv ``docker run`` gives: ENTRYPOINT (if any) then CMD, exec form required."""
    instructions = parse_dockerfile(dockerfile)
    argv: list[str] = []
    for keyword in ("ENTRYPOINT", "CMD"):
        found = [ins for ins in instructions if ins.keyword == keyword]
        if found:
            assert found[-1].value.startswith("["), f"{keyword} should use the exec (JSON) form"
            argv += words(found[-1].value)
    return argv


def command_problems(argv: list[str], pyproject: dict[str, Any], root: Path = REPO) -> list[str]:
    """Why ``argv`` does not name a console script of pyproject whose module is in the repo."""
    if not argv:
        return ["no CMD or ENTRYPOINT"]
    scripts = pyproject.get("project", {}).get("scripts", {})
    if argv[0] not in scripts:
        return [f"{argv[0]!r} is not a console script of pyproject.toml ({sorted(scripts)})"]
    module, _, function = scripts[argv[0]].partition(":")
    base = root.joinpath(*module.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not source.is_file():
        return [f"{argv[0]} -> {module}: no {base.relative_to(root)}.py in the repo"]
    if function and not re.search(rf"^def {re.escape(function)}\(", source.read_text(), re.MULTILINE):
        return [f"{argv[0]} -> {scripts[argv[0]]}: {source.relative_to(root)} defines no {function}()"]
    return []


def installed_packages(pyproject: dict[str, Any], root: Path = REPO) -> set[str]:
    """The top-level packages ``pip install .`` installs (setuptools packages.find include)."""
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return {
        p.name
        for p in root.iterdir()
        if (p / "__init__.py").is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in include)
    }


def copied_paths(dockerfile: str) -> set[str]:
    return {
        str(PurePosixPath(source))
        for ins in parse_dockerfile(dockerfile)
        if ins.keyword in ("COPY", "ADD")
        for source in copy_sources(ins)
    }


def build_commands(text: str) -> list[list[str]]:
    """Each ``docker build ...`` command in a text (``\\`` continuations joined), as argv."""
    joined = re.sub(r"\\\n\s*#?\s*", " ", text)
    commands = []
    for line in joined.splitlines():
        at = line.find("docker build ")
        if at >= 0:
            commands.append(shlex.split(line[at:].strip().strip("`")))
    return commands


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == flag]


def manifest_images() -> dict[str, set[str]]:
    """image -> the k8s/ files whose containers run it."""
    images: dict[str, set[str]] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        images.setdefault(container.get("image", "<none>"), set()).add(where)
                walk(value, where)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    for path in sorted(K8S_DIR.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc, path.name)
    return images


def _dockerfile() -> str:
    return DOCKERFILE.read_text()


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())
