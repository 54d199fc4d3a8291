"""The Dockerfile builds the image k8s/ runs, checked statically (no Docker daemon needed).

* Every COPY/ADD source exists in the repo and gets through .dockerignore (every source file
  under a copied folder too), and the copied packages are exactly the ones pyproject installs.
* The CPU path pins torch to the version the project tests with (TORCH_VERSION), from the CPU
  index; build arguments switch the base image and the torch index (the CUDA build), and every
  ``--build-arg`` the docs pass is declared.
* The default command is the ``kvfleet`` console script of pyproject and parses with the CLI;
  the image runs as a non-root user whose group is the fsGroup of the pods that mount a volume.
* Every container in k8s/ runs the one image k8s/README.md tells you to build (``docker build -t``).
Negative tests show each check reports a broken Dockerfile.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cluster.cli import build_parser
from configs import load_config

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S_DIR = REPO / "k8s"
K8S_README = K8S_DIR / "README.md"
TORCH_VERSION = "2.13.0"  # the version README.md's quick start and CI install (CPU wheel)
SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".toml", ".md", ".txt"}


# ---------------------------------------------------------------------------------------------
# A small Dockerfile reader


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest of the instruction, continuation lines joined with a space
    line: int  # 1-based line where the instruction starts


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: comments dropped, ``\\`` line continuations joined.

    Comment lines inside a continued instruction are dropped too, as Docker does. Parser
    directives (``# syntax=``, ``# escape=``) are read as comments: the escape character is ``\\``.
    """
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            instructions.append(_instruction(" ".join(p for p in parts if p), start))
            parts = []
    if parts:  # a trailing continuation ends the instruction at end of file
        instructions.append(_instruction(" ".join(p for p in parts if p), start))
    return instructions


def _instruction(text: str, line: int) -> Instruction:
    keyword, _, value = text.partition(" ")
    return Instruction(keyword.upper(), value.strip(), line)


def words(value: str) -> list[str]:
    """An instruction's arguments: the JSON (exec) form, or shell-like words."""
    if value.startswith("["):
        parsed = json.loads(value)
        assert isinstance(parsed, list) and all(isinstance(w, str) for w in parsed), value
        return parsed
    return shlex.split(value)


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=default`` defaults (an ARG without a default maps to "")."""
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            for word in words(ins.value):
                name, _, default = word.partition("=")
                defaults[name] = default
    return defaults


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` replaced by their values (unknown names stay as written)."""
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: variables.get(m.group(1) or m.group(2), m.group(0)),
        text,
    )


def copy_sources(ins: Instruction) -> list[str]:
    """The build-context paths a COPY/ADD reads ([] when it copies from a stage or image)."""
    argv = words(ins.value)
    flags = [w for w in argv if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    paths = [w for w in argv if not w.startswith("--")]
    assert len(paths) >= 2, f"line {ins.line}: {ins.keyword} needs a source and a destination"
    return paths[:-1]


# ---------------------------------------------------------------------------------------------
# .dockerignore, with Docker's rules: the last matching pattern wins, a pattern that matches a
# folder also matches everything in it, `!` re-includes, `**` spans any number of folders.


def ignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, regex) for each pattern line of a .dockerignore."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip().lstrip("/")))
        patterns.append((excludes, re.compile(_glob_regex(pattern))))
    return patterns


def _glob_regex(pattern: str) -> str:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "^" + "".join(out) + "$"


def is_ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the context path ``path`` (relative, POSIX) is left out of the build context."""
    candidates = [str(PurePosixPath(path))]
    candidates += [str(p) for p in PurePosixPath(path).parents if str(p) != "."]
    ignored = False
    for excludes, regex in patterns:
        if any(regex.match(c) for c in candidates):
            ignored = excludes
    return ignored


def _wanted_files(folder: Path) -> list[Path]:
    return [
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and ".egg-info" not in str(p)
    ]


def copy_problems(dockerfile: str, ignore: str, root: Path = REPO) -> list[str]:
    """Each COPY/ADD source that is missing under ``root`` or left out by .dockerignore."""
    patterns = ignore_patterns(ignore)
    problems = []
    for ins in parse_dockerfile(dockerfile):
        if ins.keyword not in ("COPY", "ADD"):
            continue
        for source in copy_sources(ins):
            if re.match(r"^[a-z]+://", source):
                problems.append(f"line {ins.line}: {ins.keyword} {source}: remote sources are not reproducible")
                continue
            rel = str(PurePosixPath(source.lstrip("/")))
            matches = sorted(root.glob(rel)) if any(c in rel for c in "*?[") else [root / rel]
            matches = [m for m in matches if m.exists()]
            if not matches:
                problems.append(f"line {ins.line}: {ins.keyword} {source}: no such path in the repo")
            for match in matches:
                files = _wanted_files(match) if match.is_dir() else [match]
                for file in files:
                    context_path = file.relative_to(root).as_posix()
                    if is_ignored(context_path, patterns):
                        problems.append(f"line {ins.line}: {ins.keyword} {source}: {context_path} is in .dockerignore")
    return problems


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


# ---------------------------------------------------------------------------------------------
# The Dockerfile as it is


def test_dockerfile_parses() -> None:
    instructions = parse_dockerfile(_dockerfile())
    keywords = [ins.keyword for ins in instructions]
    assert keywords.count("FROM") == 1, "one stage"
    assert keywords[0] in ("ARG", "FROM") and "COPY" in keywords and "RUN" in keywords


def test_copy_sources_exist_and_get_through_dockerignore() -> None:
    assert copied_paths(_dockerfile()), "the Dockerfile copies nothing"
    assert copy_problems(_dockerfile(), DOCKERIGNORE.read_text()) == []


def test_dockerignore_keeps_tests_and_local_state_out() -> None:
    patterns = ignore_patterns(DOCKERIGNORE.read_text())
    assert patterns
    for path in ("tests/unit/test_dockerfile.py", ".venv/bin/python", ".git/HEAD", "benchmarks/x.py"):
        assert is_ignored(path, patterns), path
    for path in ("cluster/__pycache__/cli.cpython-311.pyc", "kvfleet_cluster.egg-info/PKG-INFO"):
        assert is_ignored(path, patterns), path


def test_image_installs_exactly_the_packages_pyproject_names() -> None:
    pyproject = _pyproject()
    copied = copied_paths(_dockerfile())
    packages = installed_packages(pyproject)
    assert packages, "pyproject's packages.find includes no package of the repo"
    copied_packages = {p for p in copied if (REPO / p / "__init__.py").is_file()}
    assert copied_packages == packages, "COPY every package pyproject installs, and only those"
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied, "pip install . reads both"
    assert "serving" in packages, "the RayService imports serving.app"


def test_cpu_build_pins_the_tested_torch() -> None:
    version, index = torch_install(_dockerfile())
    assert version == TORCH_VERSION
    assert index.rstrip("/").endswith("/cpu"), f"the default build should take the CPU wheel, not {index}"
    torch_spec = next(d for d in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", d))
    assert Version(version) in SpecifierSet(torch_spec[len("torch") :]), f"pip install . would replace {version}"


def test_build_args_switch_the_base_image_and_torch_index() -> None:
    dockerfile = _dockerfile()
    assert base_image_problems(dockerfile) == []
    defaults = arg_defaults(parse_dockerfile(dockerfile))
    assert defaults["BASE_IMAGE"] == "python:3.11-slim"
    assert {"TORCH_VERSION", "TORCH_INDEX_URL"} <= set(defaults)
    documented = build_commands(K8S_README.read_text()) + build_commands(dockerfile)
    cuda = [cmd for cmd in documented if any("BASE_IMAGE=" in w for w in cmd)]
    assert cuda, "document the CUDA build (--build-arg BASE_IMAGE=...)"
    for cmd in documented:
        for setting in flag_values(cmd, "--build-arg"):
            name, _, value = setting.partition("=")
            assert name in defaults, f"--build-arg {name}: no such ARG in the Dockerfile"
            assert value and value != defaults[name], f"--build-arg {setting} changes nothing"
    for cmd in cuda:
        settings = dict(s.partition("=")[::2] for s in flag_values(cmd, "--build-arg"))
        assert "TORCH_INDEX_URL" in settings, "a CUDA base needs torch's CUDA wheel too"


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
    exposed = {int(p.split("/")[0]) for ins in parse_dockerfile(_dockerfile()) if ins.keyword == "EXPOSE"
               for p in words(ins.value)}  # fmt: skip
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


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = "# syntax=docker/dockerfile:1\nFROM x\nRUN a \\\n  # inner comment\n  && b\n\nCMD [\"c\", \"d\"]\n"
    assert parse_dockerfile(text) == [
        Instruction("FROM", "x", 2),
        Instruction("RUN", "a && b", 3),
        Instruction("CMD", '["c", "d"]', 7),
    ]
    assert words('["c", "d"]') == ["c", "d"]
    assert copy_sources(Instruction("COPY", "--chown=1:1 a b/ dest/", 1)) == ["a", "b/"]
    assert copy_sources(Instruction("COPY", "--from=builder /x /y", 1)) == []


def test_copy_of_a_missing_path_is_reported() -> None:
    text = _dockerfile() + "\nCOPY no_such_dir/ no_such_dir/\nCOPY *.nosuchext ./\n"
    problems = copy_problems(text, DOCKERIGNORE.read_text())
    assert len(problems) == 2 and "no_such_dir/" in problems[0] and "*.nosuchext" in problems[1]


def test_copy_of_an_ignored_path_is_reported() -> None:
    text = "FROM x\nCOPY tests/ tests/\nCOPY configs/ configs/\n"
    problems = copy_problems(text, DOCKERIGNORE.read_text())
    assert problems and all("tests/" in p for p in problems), problems
    assert copy_problems(text, "*\n!tests/\n!configs\nconfigs/presets/\n")
    assert copy_problems(text, "*\n!tests/\n!configs\n") == []


def test_dockerignore_rules() -> None:
    patterns = ignore_patterns("*\n!src/\n**/*.pyc\n!src/keep.pyc\n# comment\n/docs\n")
    assert is_ignored("README.md", patterns)
    assert not is_ignored("src/a/b.py", patterns)
    assert is_ignored("src/a/b.pyc", patterns)
    assert not is_ignored("src/keep.pyc", patterns)
    assert is_ignored("docs/x.md", patterns)
    assert not ignore_patterns("# only a comment\n\n")


def test_fixed_base_image_and_undeclared_arg_are_reported() -> None:
    assert base_image_problems("FROM python:3.11-slim\n")
    assert any("not declared" in p for p in base_image_problems("FROM ${BASE}\n"))
    assert any("not declared" in p for p in base_image_problems("FROM ${BASE}\nARG BASE=x\n"))
    assert base_image_problems("ARG BASE=python:3.11-slim\nFROM $BASE\n") == []


def test_torch_pin_is_read_through_build_args() -> None:
    text = "ARG V=2.1.0\nARG I=https://example.invalid/gpu\nFROM x\nRUN pip install torch==${V} --index-url $I\n"
    assert torch_install(text) == ("2.1.0", "https://example.invalid/gpu")
    with pytest.raises(AssertionError, match="no `pip install torch"):
        torch_install("FROM x\nRUN pip install .\n")


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


def test_build_command_reader_handles_continuations() -> None:
    text = "```sh\ndocker build --build-arg A=1 \\\n  -t reg/img:1 .\n```\n# docker build -t x:2 .\n"
    assert build_commands(text) == [["docker", "build", "--build-arg", "A=1", "-t", "reg/img:1", "."],
                                    ["docker", "build", "-t", "x:2", "."]]  # fmt: skip
