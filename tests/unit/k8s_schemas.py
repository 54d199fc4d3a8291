"""Loading the manifests of k8s/ and KubeRay's CRD schemas, and the two validators of the k8s tests.

* KubeRay custom resources (RayCluster, RayJob, RayService) are checked against the
  ``openAPIV3Schema`` of their CRD (tests/data/kuberay-crds/, or the folder KVFLEET_KUBERAY_CRDS
  names) with jsonschema, strictly: an object with declared properties rejects unknown fields
  (what ``kubectl apply --validate=strict`` does), so a misspelled field fails. CEL rules
  (``x-kubernetes-validations``) are not run. Without the CRDs the tests marked ``needs_crds`` skip.
* Core kinds (ConfigMap, PersistentVolumeClaim, ...) and every pod template embedded in a
  custom resource are checked with ``kubernetes-validate`` (strict) for Kubernetes K8S_VERSION.
"""

from __future__ import annotations

import functools
import os
import typing
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from configs import WorkersConfig
from configs.schema import WorkerResources

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
# KubeRay's CRDs (ray.io/v1 RayCluster, RayJob, RayService): the repository's copy (its SOURCE.md
# says where from and how it was cut down), or the folder KVFLEET_KUBERAY_CRDS names (the
# published YAML files, say). A folder without them skips the CRD-schema tests (with this reason).
CRD_DIR = Path(os.environ.get("KVFLEET_KUBERAY_CRDS") or REPO / "tests" / "data" / "kuberay-crds")
CRD_PATTERNS = ("ray.io_*.yaml", "ray.io_*.json")  # JSON is YAML: one loader reads both
needs_crds = pytest.mark.skipif(
    not any(p for pattern in CRD_PATTERNS for p in CRD_DIR.glob(pattern)),
    reason=f"KubeRay CRDs not found in {CRD_DIR} (KVFLEET_KUBERAY_CRDS)",
)
K8S_VERSION = "1.37.0"  # newest schema set kubernetes-validate 1.37 ships (v1.37.0-local-strict)
RAY_KINDS = {"RayCluster", "RayJob", "RayService"}
# The worker roles of the config schema: the WorkersConfig fields holding a WorkerResources.
ROLES = tuple(name for name, hint in typing.get_type_hints(WorkersConfig).items() if hint is WorkerResources)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD files are ~1 MB each


# ---------------------------------------------------------------------------------------------
# Loading manifests and CRD schemas


@functools.cache
def _manifests() -> tuple[tuple[str, dict[str, Any]], ...]:
    docs = []
    for path in sorted(K8S_DIR.rglob("*.y*ml")):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=_Loader)):
            if doc is not None:
                docs.append((f"{path.relative_to(REPO)}#{i}", doc))
    return tuple(docs)


def manifests(kind: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    return [(where, doc) for where, doc in _manifests() if kind is None or doc.get("kind") == kind]


def _ids(items: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [where for where, _ in items]


@functools.cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    """The jsonschema (strict) for ``kind`` at ``api_version`` (``ray.io/v1``) from its CRD file."""
    group, _, version = api_version.partition("/")
    for path in sorted(p for suffix in ("yaml", "json") for p in CRD_DIR.glob(f"{group}_*.{suffix}")):
        crd = yaml.load(path.read_text(), Loader=_Loader)
        if crd["spec"]["names"]["kind"] != kind or crd["spec"]["group"] != group:
            continue
        for entry in crd["spec"]["versions"]:
            if entry["name"] == version and entry.get("served", False):
                return openapi_to_jsonschema(entry["schema"]["openAPIV3Schema"], strict=True)
        raise LookupError(f"{path.name}: no served version {version!r} of {kind}")
    raise LookupError(f"no CRD for kind {kind!r} in group {group!r} under {CRD_DIR}")


def openapi_to_jsonschema(node: Any, *, strict: bool) -> Any:
    """A Kubernetes structural OpenAPI v3 schema as a plain (draft 4) jsonschema.

    ``x-kubernetes-int-or-string`` becomes integer|string (when the CRD did not spell that out
    with ``anyOf``), ``nullable`` admits null, ``x-kubernetes-preserve-unknown-fields`` keeps an
    object open, and with ``strict`` every other object with declared ``properties`` forbids
    unknown fields. The other ``x-kubernetes-*`` keys (list/map types, CEL validations) are
    dropped: they constrain merges and updates, not a single manifest's shape.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(item, strict=strict) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: openapi_to_jsonschema(sub, strict=strict) for name, sub in value.items()}
        elif key in ("default", "example", "enum", "required", "description"):
            out[key] = value
        else:
            out[key] = openapi_to_jsonschema(value, strict=strict)
    if node.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        strict
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _is_int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one KubeRay custom resource, as ``path: message`` lines."""
    schema = crd_schema(doc["kind"], doc["apiVersion"])
    validator = jsonschema.Draft4Validator(schema, format_checker=_FORMATS)
    return [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def core_errors(doc: dict[str, Any]) -> list[str]:
    """The kubernetes-validate (strict) verdict on one core-kind object: [] or one message."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(str(p) for p in err.path)}: {err.message}"]
    return []
