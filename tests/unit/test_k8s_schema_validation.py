"""The KubeRay manifests in k8s/ validate offline against their schemas (k8s_schemas.py says how).

* KubeRay custom resources (RayCluster, RayJob, RayService) validate against the
  ``openAPIV3Schema`` of their CRD, strictly (unknown fields fail): the repository's copy in
  tests/data/kuberay-crds/, or the folder KVFLEET_KUBERAY_CRDS names.
* Core kinds (ConfigMap, PersistentVolumeClaim, ...) and every pod template embedded in a
  custom resource validate with ``kubernetes-validate`` (strict).
Every test that walks the manifests of a kind first asserts there is one: none passes on an
empty k8s/. Negative tests mutate a manifest and show each validator catches the error.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.unit.k8s_schemas import RAY_KINDS, core_errors, crd_errors, manifests, needs_crds
from tests.unit.k8s_serving import rayservice, serve_config
from tests.unit.k8s_specs import _group, _kinds, _raycluster, cluster_specs, pod_templates

# ---------------------------------------------------------------------------------------------
# The manifests as they are


def test_k8s_dir_has_the_expected_kinds() -> None:
    assert {"RayCluster", "RayJob", "RayService", "ConfigMap", "PersistentVolumeClaim"} <= _kinds()
    for where, doc in manifests():
        assert doc.get("apiVersion") and doc.get("kind"), f"{where}: apiVersion and kind are required"
        assert doc.get("metadata", {}).get("name"), f"{where}: metadata.name is required"
    assert cluster_specs(), "no Ray cluster spec in k8s/"


def test_parametrized_manifest_sets_are_not_empty() -> None:
    """A parametrized test over zero manifests is skipped, not failed: name what each must see."""
    custom = [d.get("kind") for _, d in manifests() if d.get("kind") in RAY_KINDS]
    assert set(custom) == RAY_KINDS, f"each KubeRay kind needs a manifest to validate: {custom}"
    core = [d.get("kind") for _, d in manifests() if d.get("kind") not in RAY_KINDS]
    assert {"ConfigMap", "PersistentVolumeClaim"} <= set(core)
    # raycluster.yaml, rayjob.yaml's own cluster and rayservice.yaml's
    assert sorted(where.split("#")[0] for where, _ in cluster_specs()) == [
        "k8s/raycluster.yaml",
        "k8s/rayjob.yaml",
        "k8s/rayservice.yaml",
    ]


@needs_crds
@pytest.mark.parametrize(
    "where,doc",
    [pytest.param(w, d, id=w) for w, d in manifests() if d.get("kind") in RAY_KINDS],
)
def test_custom_resource_validates_against_its_crd(where: str, doc: dict[str, Any]) -> None:
    assert crd_errors(doc) == [], where


@pytest.mark.parametrize(
    "where,doc",
    [pytest.param(w, d, id=w) for w, d in manifests() if d.get("kind") not in RAY_KINDS],
)
def test_core_kind_validates_with_kubernetes_validate(where: str, doc: dict[str, Any]) -> None:
    assert core_errors(doc) == [], where


@pytest.mark.parametrize("where,spec", [pytest.param(w, s, id=w) for w, s in cluster_specs()])
def test_embedded_pod_templates_validate_as_core_pod_templates(where: str, spec: dict[str, Any]) -> None:
    for group, template in pod_templates(spec):
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template}
        assert core_errors(doc) == [], f"{where} group {group}"


# ---------------------------------------------------------------------------------------------
# The validators catch errors


@needs_crds
def test_crd_validation_rejects_a_wrong_type() -> None:
    doc = _raycluster()
    _group(doc, "prefill")["replicas"] = "two"
    assert any("replicas" in e and "integer" in e for e in crd_errors(doc))


@needs_crds
def test_crd_validation_rejects_a_misspelled_field() -> None:
    doc = _raycluster()
    _group(doc, "decode")["replica"] = 1
    errors = crd_errors(doc)
    assert errors and any("replica" in e for e in errors)


@needs_crds
def test_crd_validation_rejects_missing_required_and_out_of_range() -> None:
    doc = _raycluster()
    del _group(doc, "decode")["groupName"]
    _group(doc, "prefill")["maxReplicas"] = 2**31
    errors = crd_errors(doc)
    assert any("groupName" in e for e in errors)
    assert any("maxReplicas" in e and "int32" in e for e in errors)


@needs_crds
def test_crd_validation_handles_int_or_string() -> None:
    doc = _raycluster()
    group = _group(doc, "prefill")
    env = group["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": 1}}})
    assert crd_errors(doc) == []  # int-or-string accepts an integer ...
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = "1m"
    assert crd_errors(doc) == []  # ... and a quantity string
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = [1]
    assert crd_errors(doc)


@needs_crds
def test_crd_validation_rejects_a_bad_rayjob() -> None:
    ((_, job),) = [m for m in manifests("RayJob") if "rayClusterSpec" in m[1]["spec"]]
    job = copy.deepcopy(job)
    job["spec"]["shutdownAfterJobFinishes"] = "yes"
    job["spec"]["entrypiont"] = job["spec"].pop("entrypoint")
    errors = crd_errors(job)
    assert any("shutdownAfterJobFinishes" in e for e in errors)
    assert any("entrypiont" in e for e in errors)


@needs_crds
def test_crd_validation_rejects_a_bad_rayservice() -> None:
    doc = rayservice()
    doc["spec"]["serveConfigV2"] = serve_config(doc)  # a mapping where the CRD wants a string
    doc["spec"]["serveService"]["spec"]["ports"][0]["port"] = "8000"
    doc["spec"]["serveConfig"] = doc["spec"].pop("serveService")
    errors = crd_errors(doc)
    assert any(e.startswith("spec.serveConfigV2") and "string" in e for e in errors), errors
    assert any("serveConfig" in e and "Additional properties" in e for e in errors), errors
    doc["spec"]["serveService"] = doc["spec"].pop("serveConfig")
    doc["spec"]["serveConfigV2"] = rayservice()["spec"]["serveConfigV2"]
    assert any("ports.0.port" in e and "integer" in e for e in crd_errors(doc))


def test_core_validation_rejects_bad_core_objects() -> None:
    ((_, cm),) = manifests("ConfigMap")
    cm = copy.deepcopy(cm)
    cm["data"]["count"] = 3
    assert core_errors(cm)
    template = copy.deepcopy(_raycluster()["spec"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["imagee"] = "typo"
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
    assert core_errors(pod_template)
