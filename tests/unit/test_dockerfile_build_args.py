"""The Dockerfile's build arguments and torch pin, checked statically (no Docker daemon needed).

The CPU path pins torch to the version the project tests with (TORCH_VERSION), from the CPU
index; build arguments switch the base image and the torch index (the CUDA build), and every
``--build-arg`` the docs pass is declared. Negative tests show the base-image and torch checks
and the ``docker build`` reader on broken or tricky inputs.
"""

from __future__ import annotations

import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.unit.dockerfile_checks import (
    _dockerfile,
    _pyproject,
    base_image_problems,
    build_commands,
    flag_values,
    torch_install,
)
from tests.unit.dockerfile_reader import K8S_README, TORCH_VERSION, arg_defaults, parse_dockerfile

# ---------------------------------------------------------------------------------------------
# The Dockerfile as it is


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


# ---------------------------------------------------------------------------------------------
# The checks catch errors


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


def test_build_command_reader_handles_continuations() -> None:
    text = "```sh\ndocker build --build-arg A=1 \\\n  -t reg/img:1 .\n```\n# docker build -t x:2 .\n"
    assert build_commands(text) == [
        ["docker", "build", "--build-arg", "A=1", "-t", "reg/img:1", "."],
        ["docker", "build", "-t", "x:2", "."],
    ]
