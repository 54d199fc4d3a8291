"""Load a ClusterConfig from a preset name or a YAML file, with dotted ``a.b=c`` overrides.

Every failure becomes one ``ConfigError`` whose message names the field path and the bad value,
e.g. ``workers.num_decode: must be >= 1 (got -1)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from configs.schema import CROSS_FIELD_ERROR, ClusterConfig

PRESET_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "local"


class ConfigError(ValueError):
    """A configuration that cannot be used; ``str(err)`` is the readable, field-naming message."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def available_presets() -> list[str]:
    """Names of the YAML presets shipped in ``configs/presets``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(preset_or_path: str | Path = DEFAULT_PRESET, overrides: Iterable[str] = ()) -> ClusterConfig:
    """Resolve a preset name or YAML path, apply ``key.path=value`` overrides, validate.

    Override values are parsed as YAML scalars/flow collections (``2``, ``true``, ``[1, 2]``);
    raises ``ConfigError`` naming the field and value for anything wrong.
    """
    data = _read_source(preset_or_path)
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> ClusterConfig:
    """Validate a plain mapping into a ClusterConfig, translating errors into a ConfigError."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(error) for error in exc.errors()]) from None


def config_to_yaml(config: ClusterConfig) -> str:
    """The full resolved config as YAML that ``load_config`` reads back to an equal object."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def parse_override(override: str) -> tuple[str, Any]:
    """Split ``a.b=c`` into (``a.b``, parsed value); raise ConfigError if malformed."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not part.strip() for part in parts):
        raise ConfigError([f"override {override!r}: expected dotted.key=value (got {override!r})"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([f"{key}: value is not valid YAML ({_first_line(exc)}) (got {raw!r})"]) from None
    return key, value


def _read_source(preset_or_path: str | Path) -> dict[str, Any]:
    path = Path(preset_or_path).expanduser()
    looks_like_path = path.suffix in (".yaml", ".yml") or "/" in str(preset_or_path)
    if not looks_like_path:
        preset = PRESET_DIR / f"{preset_or_path}.yaml"
        if not preset.is_file():
            names = ", ".join(available_presets())
            raise ConfigError([f"config: unknown preset {str(preset_or_path)!r} (available: {names})"])
        path = preset
    if not path.is_file():
        raise ConfigError([f"config: no such file (got {str(path)!r})"])
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([f"config: {path} is not valid YAML ({_first_line(exc)})"]) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError([f"config: {path} must hold a mapping at the top level (got {type(loaded).__name__})"])
    return loaded


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node: Any = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(here, part, node)]
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, (dict, list)):
            raise ConfigError([f"{here}: cannot set {key!r} inside a non-mapping value (got {child!r})"])
        node = child
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(key, last, node)] = value
    else:
        node[last] = value


def _list_index(path: str, part: str, items: list[Any]) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError([f"{path}: no list item {part!r} (the list has {len(items)} items)"])
    return int(part)


#: readable text of pydantic's error types, shared by every edge that validates input
VALIDATION_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "extra_forbidden": "unknown field",
    "missing": "required field is missing",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "list_type": "must be a list",
    "literal_error": "must be one of {expected}",
}


def _describe(error: Mapping[str, Any]) -> str:
    loc = [str(part) for part in error["loc"]]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if error["type"] == CROSS_FIELD_ERROR:
        loc += ctx["path"].split(".")
        message, value = ctx["message"], ctx["value"]
    elif error["type"] in VALIDATION_MESSAGES:
        message = VALIDATION_MESSAGES[error["type"]].format(**ctx)
    else:
        message = str(error["msg"]).removeprefix("Value error, ")
    path = ".".join(loc) or "config"
    if error["type"] == "missing":
        return f"{path}: {message}"
    return f"{path}: {message} (got {value!r})"


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]
