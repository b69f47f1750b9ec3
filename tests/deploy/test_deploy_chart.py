"""The Helm chart, rendered by Helm's Go engine, linted strictly, and checked object by object.

Each scenario is a values file under `values/` (plus the chart defaults): 1 and 8 replicas, monitoring on and
off (with and without the engine's own metrics), auth with a fixed or existing token, network policy, pod-IP
addressing, each kind of model storage, a runtime class, name overrides. An offline render must name the
token's source, so scenarios that leave `auth` out are rendered with `deploy_render.OFFLINE_TOKEN`.

This module holds Helm's own checks (lint, the values schema), every object against the published schemas,
and the names objects get and select each other by. The scenario renders (`rendered`, tests/deploy/conftest.py)
are shared with the modules that check the rest: the pod (`test_deploy_chart_pod.py`), its command lines
(`test_deploy_chart_commands.py`), security and the token (`test_deploy_chart_security.py`), and the
monitoring objects (`test_deploy_chart_monitoring.py`).
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml
from deploy_render import (
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    effective_values,
    is_hook,
    of_kind,
    offline,
    one,
    render,
    render_manifests,
    scenario_values,
    scenarios,
    validate,
)

SCENARIOS = scenarios()


# ---- Helm's own checks ------------------------------------------------------------------------------


def test_scenarios_cover_the_brief() -> None:
    assert {"defaults", "replicas-8", "monitoring-on", "network-policy", "auth-fixed-token"} <= set(SCENARIOS)
    assert "replicas-1-monitoring-off-auth-off" in SCENARIOS
    # Every option of issue 13's chart item has a values file that turns it on.
    merged = {s: effective_values(scenario_values(s)) for s in SCENARIOS}
    assert {v["modelStorage"]["type"] for v in merged.values()} == {"emptyDir", "perPod", "pvc", "existingClaim"}
    assert any(v["modelStorage"]["readOnly"] for v in merged.values())
    assert any(v["runtimeClassName"] for v in merged.values())
    assert any(v["monitoringLabels"] for v in merged.values())
    assert any(v["serviceMonitor"]["enabled"] and v["engine"]["metrics"]["enabled"] for v in merged.values())
    assert any(not v["engine"]["metrics"]["enabled"] for v in merged.values())
    assert any(v["fullnameOverride"] for v in merged.values())
    assert any(v["auth"]["existingSecret"] for v in merged.values())


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict_is_clean(scenario: str) -> None:
    values = offline(scenario_values(scenario))
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error; 1 is info
    assert report["errors"] == [] and problems == [], report


def test_values_outside_the_schema_are_rejected() -> None:
    bad_values: list[dict[str, Any]] = [
        {"replicaCunt": 2},  # a typo
        {"engine": {"mode": "fast"}},
        {"engine": {"gpus": -1}},
        {"engine": {"resources": {"limits": {"memory": "lots"}}}},
        {"sidecar": {"port": 70000}},
        {"sidecar": {"advertise": "hostname"}},
        {"spool": {"sizeMiB": "8Gi"}},
        {"spool": {"reservePercent": 0}},
        {"spool": {"mountPath": "relative/path"}},
        {"auth": {"enabled": "yes"}},
        {"serviceMonitor": {"interval": "often"}},
        {"networkPolicy": {"trainerNamespaces": "rl"}},
        {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}},
        {"modelStorage": {"type": "hostPath"}},
        {"modelStorage": {"sizeGiB": "200Gi"}},
        {"modelStorage": {"type": "existingClaim"}},  # which claim?
        {"modelStorage": {"accessModes": ["ReadWriteSometimes"]}},
        {"modelStorage": {"mountPath": "models"}},
        {"engine": {"ephemeralStorageGiB": -1}},
        {"engine": {"metrics": {"enabled": "yes"}}},
        {"runtimeClassName": "NVIDIA_Runtime"},
        {"monitoringLabels": {"release": 1}},
        {"serviceMonitor": {"engine": {"enabled": 1}}},
        {"sidecar": {"readinessProbe": {"periodSeconds": 5}}},  # removed: pod readiness is the engine's
    ]
    for values in bad_values:
        with pytest.raises(helm.HelmValuesError, match="schema"):
            render_manifests(values)
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"], f"lint accepted {values}"


def test_every_value_is_described_by_the_schema() -> None:
    """Every key of values.yaml appears in values.schema.json, and objects with fixed keys are closed."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(value, dict) or "properties" not in node:
            return
        assert node.get("additionalProperties") is False, f"{path or '<root>'} accepts unknown keys"
        for key, sub in value.items():
            assert key in node["properties"], f"{path}.{key} is not in the schema"
            walk(sub, node["properties"][key], f"{path}.{key}")

    walk(values, schema, "")
    helm.Chart.load(CHART).validate_schema(values)


# ---- every object against the published schemas -------------------------------------------------


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_objects_match_published_schemas(rendered: tuple[dict, list], k8s_version: str) -> None:
    _, objects = rendered
    assert objects
    for obj in objects:
        validate(obj, k8s_version)


def test_schema_validation_catches_a_bad_object() -> None:
    """The validators above are not vacuous: a misspelt field fails for each kind family."""
    objects = render(scenario_values("monitoring-on"))
    sts = json.loads(json.dumps(one(objects, "StatefulSet")))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    monitor = json.loads(json.dumps(of_kind(objects, "ServiceMonitor")[0]))
    monitor["spec"]["endpoints"][0]["intervall"] = "10s"
    rule = json.loads(json.dumps(one(objects, "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    for obj in (sts, monitor, rule):
        with pytest.raises(Exception, match=r"paht|intervall|five minutes"):
            validate(obj, K8S_VERSIONS[0])


def test_hooks_are_only_the_test_pod(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    assert [o["kind"] for o in objects if is_hook(o)] == ["Pod"]


# ---- names and selectors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "overrides", "fullname"),
    [
        ("r3", {}, "r3-sidecar"),  # the chart name already starts with `r3-`: not r3-r3-sidecar
        ("prod", {}, "prod-r3-sidecar"),
        ("r3-sidecar", {}, "r3-sidecar"),  # the release contains the chart name
        ("rl-r3-sidecar-a", {}, "rl-r3-sidecar-a"),
        ("r3", {"nameOverride": "sgl"}, "r3-sgl"),
        ("r3", {"nameOverride": "r3-moe"}, "r3-moe"),
        ("prod", {"fullnameOverride": "qwen-rollouts"}, "qwen-rollouts"),
        ("a" * 53, {}, "a" * 52),  # Helm's longest release name; see r3.fullname for 52
    ],
)
def test_fullname_rules(release: str, overrides: dict[str, Any], fullname: str) -> None:
    objects = render(overrides, release=release)
    sts = one(objects, "StatefulSet")
    assert sts["metadata"]["name"] == fullname
    helm.validate_release_name(release)
    for obj in objects:
        name = obj["metadata"]["name"]
        assert name.startswith(fullname) and len(name) <= 63, name
        assert f"{release}-{release}" not in name
    # Truncation never makes two objects of a kind share a name; pod names (<sts>-<ordinal>) stay DNS labels.
    kinds_names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(set(kinds_names)) == len(kinds_names), kinds_names
    assert len(sts["metadata"]["name"]) <= 52


def test_names_follow_the_fullname_everywhere_they_are_referenced(rendered: tuple[dict, list]) -> None:
    """The Services, Secret and ConfigMap the pod names exist under those names (overrides included)."""
    _, objects = rendered
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    sts = one(objects, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert ("Service", sts["spec"]["serviceName"]) in names
    for ctr in pod["containers"]:
        for source in ctr.get("envFrom", []):
            assert ("ConfigMap", source["configMapRef"]["name"]) in names
    if pod.get("serviceAccountName") and effective_values({})["serviceAccount"]["create"]:
        assert ("ServiceAccount", pod["serviceAccountName"]) in names


def test_selectors_pick_the_sglang_pods_and_nothing_else(rendered: tuple[dict, list]) -> None:
    """Services, the PDB and the NetworkPolicy select the StatefulSet's pods, never the helm test pod."""
    _, objects = rendered
    sts = one(objects, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    test_labels = one(objects, "Pod", hook=True)["metadata"]["labels"]
    selectors = [sts["spec"]["selector"]["matchLabels"]]
    selectors += [s["spec"]["selector"] for s in of_kind(objects, "Service")]
    selectors += [p["spec"]["selector"]["matchLabels"] for p in of_kind(objects, "PodDisruptionBudget")]
    selectors += [n["spec"]["podSelector"]["matchLabels"] for n in of_kind(objects, "NetworkPolicy")]
    for selector in selectors:
        assert selector.items() <= pod_labels.items(), selector
        assert not selector.items() <= test_labels.items(), selector
