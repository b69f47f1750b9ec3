"""The chart's monitoring objects, scenario by scenario (`rendered`, tests/deploy/conftest.py): a ServiceMonitor
for the sidecar and one for SGLang's own metrics, the PrometheusRule and the Grafana dashboard, each behind its
switch, with the labels a Prometheus operator selects them by. What the rules and the dashboard say is
tests/deploy/test_deploy_monitoring.py's.
"""

from __future__ import annotations

import json

import helm_python as helm
import pytest
import yaml
from deploy_render import (
    DASHBOARD_FILE,
    NAMESPACE,
    RULES_FILE,
    container,
    effective_values,
    of_kind,
    one,
    render,
    render_manifests,
    sidecar_routes,
)


def test_monitoring_objects_follow_their_switches(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = effective_values(values)
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in of_kind(objects, "ServiceMonitor")}
    rules = of_kind(objects, "PrometheusRule")
    dashboards = [c for c in of_kind(objects, "ConfigMap") if "r3-sidecar.json" in c.get("data", {})]
    sm = v["serviceMonitor"]
    engine_sm = sm["enabled"] and sm["engine"]["enabled"] and v["engine"]["metrics"]["enabled"]
    assert set(monitors) == ({"sidecar"} if sm["enabled"] else set()) | ({"engine"} if engine_sm else set())
    assert len(rules) == int(v["prometheusRule"]["enabled"])
    assert len(dashboards) == int(v["grafanaDashboard"]["enabled"])
    pod = one(objects, "StatefulSet")["spec"]["template"]
    # Each ServiceMonitor selects exactly one Service of this release, headless and listing pods that are not
    # ready (a loading engine, a sidecar serving while its engine restarts), whose named port reaches the
    # right container; the path is /metrics.
    targets = {"sidecar": container(objects, "sidecar"), "engine": container(objects, "engine")}
    for component, monitor in monitors.items():
        (endpoint,) = monitor["spec"]["endpoints"]
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in of_kind(objects, "Service") if wanted <= s["metadata"]["labels"].items()]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port["targetPort"] in {p["name"] for p in targets[component]["ports"]}, component
        assert endpoint["path"] == "/metrics"
        assert endpoint["interval"] == sm["interval"] and endpoint["scrapeTimeout"] == sm["scrapeTimeout"]
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    if "sidecar" in monitors:
        assert ("GET", "/metrics") in sidecar_routes()
    for rule in rules:
        assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    for dashboard in dashboards:
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["r3-sidecar.json"]) == json.loads(DASHBOARD_FILE.read_text())


def test_monitoring_labels_reach_every_monitoring_object(rendered: tuple[dict, list]) -> None:
    """`monitoringLabels` (e.g. kube-prometheus-stack's `release`) on both ServiceMonitors and the rule; each
    object's own labels add to them and win a conflict."""
    values, objects = rendered
    v = effective_values(values)
    own_labels = {"ServiceMonitor": v["serviceMonitor"]["labels"], "PrometheusRule": v["prometheusRule"]["labels"]}
    for kind, own in own_labels.items():
        for obj in of_kind(objects, kind):
            expected = {**v["monitoringLabels"], **own}
            assert expected.items() <= obj["metadata"]["labels"].items(), (kind, obj["metadata"]["labels"])


def test_monitoring_labels_merge_and_override() -> None:
    objects = render(
        {
            "monitoringLabels": {"release": "kube-prometheus-stack", "team": "rl"},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom-sm"}},
            "prometheusRule": {"enabled": True},
        }
    )
    monitors = of_kind(objects, "ServiceMonitor")
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "prom-sm" and monitor["metadata"]["labels"]["team"] == "rl"
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # Nothing else carries them: they would make other selectors pick these objects up.
    for obj in objects:
        if obj["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            assert "team" not in obj["metadata"].get("labels", {}), obj["kind"]


def test_engine_metrics_are_enabled_and_scraped_by_their_own_servicemonitor() -> None:
    objects = render({"serviceMonitor": {"enabled": True}})
    assert "--enable-metrics" in container(objects, "engine")["args"]
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in of_kind(objects, "ServiceMonitor")}
    engine_monitor = monitors["engine"]
    assert engine_monitor["spec"]["endpoints"][0]["port"] == "http-engine"
    assert engine_monitor["metadata"]["name"] != one(objects, "StatefulSet")["metadata"]["name"]
    # Off: no flag, no engine ServiceMonitor or Service; asking for the ServiceMonitor anyway is an error.
    metrics_off = {"engine": {"metrics": {"enabled": False}}}
    off = render({**metrics_off, "serviceMonitor": {"enabled": True, "engine": {"enabled": False}}})
    assert "--enable-metrics" not in container(off, "engine")["args"]
    assert len(of_kind(off, "ServiceMonitor")) == 1 and len(of_kind(off, "Service")) == 2
    with pytest.raises(helm.HelmRenderError, match=r"serviceMonitor\.engine\.enabled needs engine\.metrics\.enabled"):
        render_manifests({"engine": {"metrics": {"enabled": False}}, "serviceMonitor": {"enabled": True}})
