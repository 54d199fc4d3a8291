"""A small static reader of the Dockerfile and .dockerignore for the Dockerfile tests (no Docker
daemon needed): the instructions, ARG defaults, COPY/ADD sources, Docker's .dockerignore rules,
and ``copy_problems`` (each COPY source missing from the repo or left out by .dockerignore).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
