"""The Dockerfile's build context, checked statically (no Docker daemon needed).

The Dockerfile parses; every COPY/ADD source exists in the repo and gets through .dockerignore
(every source file under a copied folder too), .dockerignore keeps tests and local state out, and
the copied packages are exactly the ones pyproject installs. Negative tests show the parser, the
.dockerignore rules and the COPY check on broken inputs.
"""

from __future__ import annotations

from tests.unit.dockerfile_checks import _dockerfile, _pyproject, copied_paths, installed_packages
from tests.unit.dockerfile_reader import (
    DOCKERIGNORE,
    REPO,
    Instruction,
    copy_problems,
    copy_sources,
    ignore_patterns,
    is_ignored,
    parse_dockerfile,
    words,
)

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


# ---------------------------------------------------------------------------------------------
# The checks catch errors


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = '# syntax=docker/dockerfile:1\nFROM x\nRUN a \\\n  # inner comment\n  && b\n\nCMD ["c", "d"]\n'
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
