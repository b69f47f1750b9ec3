"""The Helm chart, rendered by Helm's Go engine, linted strictly, and checked object by object.

Each scenario is a values file under `values/` (plus the chart defaults): 1 and 8 replicas, monitoring on and
off (with and without the engine's own metrics), auth with a fixed or existing token, network policy, pod-IP
addressing, each kind of model storage, a runtime class, name overrides. An offline render must name the
token's source, so scenarios that leave `auth` out are rendered with `deploy_render.OFFLINE_TOKEN`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import helm_python as helm
import pytest
import yaml
from deploy_render import (
    CHART,
    DASHBOARD_FILE,
    K8S_VERSIONS,
    NAMESPACE,
    OFFLINE_TOKEN,
    RULES_FILE,
    chart_seeing_cluster,
    container,
    is_hook,
    kube_root_ca,
    of_kind,
    offline,
    one,
    parse,
    quantity_bytes,
    render,
    render_manifests,
    resolved_env,
    scenario_values,
    scenarios,
    secret,
    secret_value,
    validate,
)
from pod_security import restricted_violations

from service.server.api import create_app
from service.server.settings import Settings
from service.spool import Spool

SCENARIOS = scenarios()


@pytest.fixture(scope="module", params=SCENARIOS)
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = scenario_values(request.param)
    return values, render(values)


def _values(values: dict[str, Any]) -> dict[str, Any]:
    """The values Helm actually uses: chart defaults coalesced with the scenario (as rendered, see `offline`)."""
    return helm.Chart.load(CHART).merge_values(offline(values))


# ---- Helm's own checks ------------------------------------------------------------------------------


def test_scenarios_cover_the_brief() -> None:
    assert {"defaults", "replicas-8", "monitoring-on", "network-policy", "auth-fixed-token"} <= set(SCENARIOS)
    assert "replicas-1-monitoring-off-auth-off" in SCENARIOS
    # Every option of issue 13's chart item has a values file that turns it on.
    merged = {s: _values(scenario_values(s)) for s in SCENARIOS}
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


# ---- the pod: spool, settings, addressing ---------------------------------------------------------


def test_both_containers_share_the_spool_where_the_settings_point(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    spool_volume = next(vol for vol in pod["volumes"] if vol["name"] == "spool")
    assert spool_volume["emptyDir"]["medium"] == "Memory"

    mounts = {}
    for name in ("spool-init", "engine", "sidecar"):
        ctr = container(objects, name)
        (mount,) = [m for m in ctr["volumeMounts"] if m["name"] == "spool"]
        mounts[name] = mount["mountPath"]
        if name != "spool-init":
            assert resolved_env(objects, ctr)["R3_SPOOL_DIR"] == mount["mountPath"]
    assert len(set(mounts.values())) == 1 and mounts["engine"] == v["spool"]["mountPath"]
    assert container(objects, "spool-init")["command"][-1] == mounts["engine"]

    # The writers' cap sits below the kubelet's eviction limit, by the configured reserve.
    size = quantity_bytes(spool_volume["emptyDir"]["sizeLimit"])
    assert size == v["spool"]["sizeMiB"] << 20
    max_bytes = int(resolved_env(objects, container(objects, "engine"))["R3_SPOOL_MAX_BYTES"])
    assert max_bytes == size * (100 - v["spool"]["reservePercent"]) // 100
    assert 0 < max_bytes < size


def test_r3_settings_reach_both_containers_consistently(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    engine = resolved_env(objects, container(objects, "engine"))
    sidecar = resolved_env(objects, container(objects, "sidecar"))
    shared = ("R3_SPOOL_DIR", "R3_SPOOL_MAX_BYTES", "R3_MODE", "R3_TTL_S", "R3_STALE_S", "R3_SIDECAR_URL")
    for key in shared:
        assert engine[key] == sidecar[key], key
    assert engine["R3_MODE"] == v["engine"]["mode"]
    assert engine["R3_BUDGET"] == v["engine"]["budget"]
    assert float(sidecar["R3_TTL_S"]) == v["sidecar"]["ttlSeconds"]
    assert engine["R3_ENGINE_ID"] == "$(POD_NAME)"
    assert int(sidecar["R3_PORT"]) == v["sidecar"]["port"]

    # What each process will actually parse: the real settings classes accept these values.
    plain = {k: val for k, val in sidecar.items() if k.startswith("R3_") and isinstance(val, str)}
    os_env = {**plain, "R3_AUTH_TOKEN": "x"}
    settings = _settings_from(os_env)
    assert str(settings.spool_dir) == sidecar["R3_SPOOL_DIR"]
    assert settings.spool_max_bytes == int(sidecar["R3_SPOOL_MAX_BYTES"])
    assert settings.port == v["sidecar"]["port"]

    sts = one(objects, "StatefulSet")
    args = container(objects, "engine")["args"]
    assert "--enable-return-routed-experts" in args
    assert args[args.index("--port") + 1] == str(v["engine"]["port"])
    assert args[args.index("--model-path") + 1] == v["engine"]["model"]
    assert sts["spec"]["replicas"] == v["replicaCount"]


def _settings_from(env: dict[str, str]) -> Settings:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("R3_")}
    os.environ.update(env)
    try:
        return Settings()
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def test_sidecar_url_is_the_pods_own_address(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    sts = one(objects, "StatefulSet")
    for name in ("engine", "sidecar"):
        env_list = [e["name"] for e in container(objects, name)["env"]]
        # $(VAR) expands only variables defined earlier in the same list.
        assert env_list.index("POD_NAME") < env_list.index("R3_SIDECAR_URL")
        assert env_list.index("POD_IP") < env_list.index("R3_SIDECAR_URL")
    env = {e["name"]: e for e in container(objects, "engine")["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    url = env["R3_SIDECAR_URL"]["value"]
    port = v["sidecar"]["port"]
    sidecar_ports = {p["name"]: p["containerPort"] for p in container(objects, "sidecar")["ports"]}
    assert sidecar_ports["http-r3"] == port

    headless = next(s for s in of_kind(objects, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    if v["sidecar"]["advertise"] == "podIP":
        assert url == f"http://$(POD_IP):{port}"
    else:
        # <pod>.<serviceName>.<namespace>.svc.<domain>: the StatefulSet's governing headless Service.
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert url == f"http://$(POD_NAME).{headless['metadata']['name']}.{NAMESPACE}.svc.{v['clusterDomain']}:{port}"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert all(pod_labels.get(k) == val for k, val in headless["spec"]["selector"].items())
    assert [p["targetPort"] for p in headless["spec"]["ports"]] == ["http-r3"]


def test_engine_service_reaches_sglang(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    engine = container(objects, "engine")
    service = next(s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") != "None")
    (port,) = service["spec"]["ports"]
    assert port["port"] == v["service"]["port"]
    assert {p["name"]: p["containerPort"] for p in engine["ports"]}[port["targetPort"]] == v["engine"]["port"]
    gpus = engine["resources"]["limits"][v["engine"]["gpuResourceName"]]
    assert gpus == engine["resources"]["requests"][v["engine"]["gpuResourceName"]] == str(v["engine"]["gpus"])


# ---- auth -----------------------------------------------------------------------------------------


def test_the_secret_reaches_r3_auth_token(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    env = {e["name"]: e for e in container(objects, "sidecar")["env"]}
    secrets = of_kind(objects, "Secret")
    if not v["auth"]["enabled"]:
        assert "R3_AUTH_TOKEN" not in env and secrets == []
        return
    ref = env["R3_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] == v["auth"]["secretKey"]
    if v["auth"]["existingSecret"]:
        assert secrets == [] and ref["name"] == v["auth"]["existingSecret"]
        return
    (secret,) = secrets
    assert ref["name"] == secret["metadata"]["name"]
    token = secret_value(secret, ref["key"])
    # Offline, only a given token renders (the others fail: test_offline_render_without_a_token_fails_every_time).
    assert token == (v["auth"]["token"] if "auth" in values else OFFLINE_TOKEN)
    assert token == v["auth"]["token"] and secret["metadata"]["annotations"]["r3-sidecar.io/token-source"] == "value"
    assert "R3_AUTH_TOKEN" not in {e["name"] for e in container(objects, "engine")["env"]}


# ---- probes and the helm test against the real app ----------------------------------------------


def _app_routes() -> set[tuple[str, str]]:
    app = create_app(Settings(spool_dir=Path("/nonexistent-r3-spool")))
    return {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}


def test_probes_hit_routes_the_sidecar_serves(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    routes = _app_routes()
    sidecar = container(objects, "sidecar")
    ports = {p["name"] for p in sidecar["ports"]}
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    get = sidecar["livenessProbe"]["httpGet"]
    assert ("GET", get["path"]) in routes and get["port"] in ports
    engine = container(objects, "engine")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert engine[probe]["httpGet"]["port"] in {p["name"] for p in engine["ports"]}
    test_pod = one(objects, "Pod", hook=True)
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert ("GET", "/readyz") in routes and "/readyz" in test_pod["spec"]["containers"][0]["args"][0]


def test_probe_routes_answer_200_on_a_live_sidecar(serve: Any) -> None:
    """The probe paths answer 200 on a real sidecar, without a token even when auth is on."""
    import httpx

    base = serve(auth_token="probe-test-token")
    objects = render()
    sidecar = container(objects, "sidecar")
    for path in (sidecar["livenessProbe"]["httpGet"]["path"], "/readyz"):  # /readyz: the helm test's
        r = httpx.get(base + path, timeout=5)
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(base + "/v1/engines", timeout=5).status_code == 401


def test_helm_test_pod_curls_every_pod(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    script = one(objects, "Pod", hook=True)["spec"]["containers"][0]["args"][0]
    sts = one(objects, "StatefulSet")
    assert f"-lt {v['replicaCount']} ]" in script
    assert f"{sts['metadata']['name']}-$i.{sts['spec']['serviceName']}.{NAMESPACE}.svc" in script
    assert f":{v['sidecar']['port']}/readyz" in script


def test_spool_init_makes_directories_both_containers_can_write(tmp_path: Path) -> None:
    """Run the init container's own command here: the spool tree it leaves is group-writable and setgid."""
    objects = render()
    init = container(objects, "spool-init")
    root = tmp_path / "spool"
    root.mkdir()
    cmd = [sys.executable, *init["command"][1:-1], str(root)]
    subprocess.run(cmd, check=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    spool = Spool(root, create=False)
    for path in (root / "v1", spool.records_dir, spool.engines_dir):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o2775, (path, oct(mode))


# ---- security, disruption, optional objects ------------------------------------------------------


def test_security_contexts(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    # A Service named `r3` would otherwise inject R3_PORT=tcp://… into both containers' settings.
    assert pod["enableServiceLinks"] is False
    for name in ("spool-init", "sidecar"):
        ctx = container(objects, name)["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["readOnlyRootFilesystem"] is True and ctx["runAsUser"] > 0
    # Engine and sidecar share the spool through the pod's fsGroup.
    assert pod["securityContext"]["fsGroup"] == container(objects, "sidecar")["securityContext"]["runAsGroup"]
    for name in ("engine", "sidecar"):
        assert container(objects, name)["resources"]["limits"]["memory"]


def test_pods_pass_pod_security_restricted(rendered: tuple[dict, list]) -> None:
    """Every pod the chart makes (the SGLang pods and the helm test pod) is admitted by a namespace that
    enforces Pod Security `restricted`: the engine included, as a non-root uid."""
    _, objects = rendered
    sts = one(objects, "StatefulSet")
    template = sts["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
    test_pod = one(objects, "Pod", hook=True)
    assert restricted_violations(test_pod["spec"], test_pod["metadata"].get("annotations")) == []
    engine = container(objects, "engine")["securityContext"]
    assert engine["runAsNonRoot"] is True and engine["runAsUser"] > 0


def test_the_engine_runs_as_non_root_with_writable_dirs_as_volumes() -> None:
    """A uid with no passwd entry in SGLang's image: HOME and USER are given, and every place the engine
    writes (HOME's caches, /tmp, HF_HOME, the spool, /dev/shm) is a volume, none the image's root-owned tree."""
    objects = render()
    engine = container(objects, "engine")
    env = resolved_env(objects, engine)
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    volumes = {v["name"]: v for v in one(objects, "StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    assert env["USER"] and env["HOME"] == _values({})["engine"]["home"]
    for path in (env["HOME"], "/tmp", env["HF_HOME"], env["R3_SPOOL_DIR"], "/dev/shm"):
        assert path in mounts and not any(m.get("readOnly") for m in engine["volumeMounts"] if m["mountPath"] == path)
        assert "emptyDir" in volumes[mounts[path]], path
    assert (
        engine["securityContext"]["runAsGroup"]
        == one(objects, "StatefulSet")["spec"]["template"]["spec"]["securityContext"]["fsGroup"]
    )


def test_the_restricted_checks_catch_each_violation() -> None:
    """The checks above are not vacuous: each mutation of the rendered pod breaks the control it names."""
    import copy

    template = one(render(), "StatefulSet")["spec"]["template"]
    assert restricted_violations(template["spec"]) == []

    def engine_ctx(pod: dict) -> dict:
        return next(c for c in pod["containers"] if c["name"] == "engine")["securityContext"]

    mutations = {
        "runAsNonRoot is not true": lambda p: engine_ctx(p).update(runAsNonRoot=False),
        "runAsUser 0": lambda p: engine_ctx(p).update(runAsUser=0),
        "allowPrivilegeEscalation": lambda p: engine_ctx(p).pop("allowPrivilegeEscalation"),
        "does not drop ALL": lambda p: engine_ctx(p).update(capabilities={"drop": ["NET_RAW"]}),
        "adds ['SYS_ADMIN']": lambda p: engine_ctx(p)["capabilities"].update(add=["SYS_ADMIN"]),
        "privileged": lambda p: engine_ctx(p).update(privileged=True),
        "seccompProfile Unconfined": lambda p: engine_ctx(p).update(seccompProfile={"type": "Unconfined"}),
        "hostPath": lambda p: p["volumes"].append({"name": "models", "hostPath": {"path": "/models"}}),
        "spec.hostIPC": lambda p: p.update(hostIPC=True),
        "hostPort 30000": lambda p: next(c for c in p["containers"] if c["name"] == "engine")["ports"][0].update(
            hostPort=30000
        ),
    }
    for expected, mutate in mutations.items():
        pod = copy.deepcopy(template["spec"])
        mutate(pod)
        found = restricted_violations(pod)
        assert any(expected in line for line in found), (expected, found)
    # Pod-level runAsNonRoot covers containers that leave it unset; without it, each must set it.
    pod = copy.deepcopy(template["spec"])
    engine_ctx(pod).pop("runAsNonRoot")
    assert restricted_violations(pod) == []
    pod["securityContext"].pop("runAsNonRoot")
    assert any("containers[engine]: runAsNonRoot" in line for line in restricted_violations(pod))


def test_disruption_budget(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    pdbs = of_kind(objects, "PodDisruptionBudget")
    if not v["podDisruptionBudget"]["enabled"]:
        assert pdbs == []
        return
    (pdb,) = pdbs
    pod_labels = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == v["podDisruptionBudget"]["maxUnavailable"]
    assert all(pod_labels[k] == val for k, val in pdb["spec"]["selector"]["matchLabels"].items())


def test_monitoring_objects_follow_their_switches(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
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
        assert ("GET", "/metrics") in _app_routes()
    for rule in rules:
        assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    for dashboard in dashboards:
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["r3-sidecar.json"]) == json.loads(DASHBOARD_FILE.read_text())


def test_monitoring_labels_reach_every_monitoring_object(rendered: tuple[dict, list]) -> None:
    """`monitoringLabels` (e.g. kube-prometheus-stack's `release`) on both ServiceMonitors and the rule; each
    object's own labels add to them and win a conflict."""
    values, objects = rendered
    v = _values(values)
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


def test_network_policy_limits_the_sidecar_port_to_trainers(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    policies = of_kind(objects, "NetworkPolicy")
    if not v["networkPolicy"]["enabled"]:
        assert policies == []
        return
    (policy,) = policies
    pod_labels = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == val for k, val in policy["spec"]["podSelector"]["matchLabels"].items())
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(by_port) == {"http-r3", "http-engine"}
    peers = by_port["http-r3"]["from"]
    allowed_names: set[str] = set()
    for peer in peers:
        for expr in peer.get("namespaceSelector", {}).get("matchExpressions", []):
            assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "In"
            allowed_names |= set(expr["values"])
    netpol = v["networkPolicy"]
    assert allowed_names == set(netpol["trainerNamespaces"]) | set(netpol["monitoringNamespaces"])
    if v["networkPolicy"]["trainerNamespaceSelector"]:
        assert {"namespaceSelector": v["networkPolicy"]["trainerNamespaceSelector"]} in peers
    # No peer without a namespace or pod selector: nothing opens the port to every namespace.
    assert all("namespaceSelector" in p or "podSelector" in p for p in peers)
    test_pod = one(objects, "Pod", hook=True)
    test_peer = next(p for p in peers if "podSelector" in p and "namespaceSelector" not in p)
    assert test_peer["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
    engine_peers = by_port["http-engine"].get("from", [])
    if not v["networkPolicy"]["enginePeers"]:
        assert engine_peers == []  # open to all
        return
    # enginePeers, plus the monitoring namespaces for SGLang's own /metrics on the same port.
    monitoring = []
    if v["engine"]["metrics"]["enabled"] and netpol["monitoringNamespaces"]:
        expr = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": netpol["monitoringNamespaces"]}
        monitoring = [{"namespaceSelector": {"matchExpressions": [expr]}}]
    assert engine_peers == v["networkPolicy"]["enginePeers"] + monitoring


def test_hooks_are_only_the_test_pod(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    assert [o["kind"] for o in objects if is_hook(o)] == ["Pod"]


def test_notes_tell_how_to_fetch_a_rid() -> None:
    notes = render_manifests()["r3-sidecar/templates/NOTES.txt"]
    assert "/routed_experts/<rid>" in notes and "Authorization: Bearer" in notes and "helm test" in notes
    from service.server.cli import build_parser

    (exec_line,) = [line for line in notes.splitlines() if "kubectl exec" in line]
    args = build_parser().parse_args(exec_line.split(" -- ", 1)[1].split()[1:])
    assert args.command == "fetch" and args.url == f"http://127.0.0.1:{_values({})['sidecar']['port']}"
    assert ("GET", "/routed_experts/{rid:path}") in _app_routes()
    notes_off = render_manifests({"auth": {"enabled": False}})["r3-sidecar/templates/NOTES.txt"]
    assert "Authorization" not in notes_off and "/routed_experts/<rid>" in notes_off


# ---- command lines against the real parsers ------------------------------------------------------

_SGLANG_PARSE = """
import argparse, json, sys
from importlib.metadata import version
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
out = {"sglang": version("sglang")}
for scenario, argv in json.loads(sys.argv[1]).items():
    ns = parser.parse_args(argv)
    keys = ("model_path", "port", "tp_size", "enable_return_routed_experts", "enable_metrics")
    out[scenario] = {k: getattr(ns, k) for k in keys}
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_engine_command_line_parses_with_sglang_0_5_23() -> None:
    """SGLang 0.5.23's own argument parser accepts every rendered engine command line, with no deprecated flag."""
    argv = {s: container(render(scenario_values(s)), "engine")["args"] for s in SCENARIOS}
    engine = container(render(), "engine")
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    out = subprocess.run(
        [sys.executable, "-c", _SGLANG_PARSE, json.dumps(argv)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "deprecated" not in out.stderr.lower(), out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed.pop("sglang") == "0.5.23"
    for scenario, args in parsed.items():
        v = _values(scenario_values(scenario))
        assert args == {
            "model_path": v["engine"]["model"],
            "port": v["engine"]["port"],
            "tp_size": v["engine"]["tensorParallelSize"],
            "enable_return_routed_experts": True,
            "enable_metrics": v["engine"]["metrics"]["enabled"],
        }, scenario


def test_sidecar_command_line_parses_with_the_real_cli(rendered: tuple[dict, list]) -> None:
    from service.server.cli import build_parser

    values, objects = rendered
    v = _values(values)
    args = build_parser().parse_args(container(objects, "sidecar")["args"])
    assert args.command == "serve"
    assert int(args.setting_port) == v["sidecar"]["port"] and args.setting_host == "0.0.0.0"


def _kubelet_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of an env value from variables defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


@pytest.mark.parametrize("scenario", ["defaults", "pod-ip-custom-spool"])
def test_advertised_url_fetches_the_record_from_the_sidecar(scenario: str, spool: Spool, serve: Any) -> None:
    """The engine's own settings and URL builder, fed the rendered environment of pod 3, yield a URL whose
    host is that pod and whose path a live sidecar answers with the record."""
    import httpx
    from helpers import random_rows, write_record

    from engine_ext.core.records import routed_experts_url
    from engine_ext.core.settings import EngineSettings

    v = _values(scenario_values(scenario))
    objects = render(scenario_values(scenario))
    pod_name, pod_ip = f"{one(objects, 'StatefulSet')['metadata']['name']}-3", "10.1.2.3"
    downward = {"POD_NAME": pod_name, "POD_IP": pod_ip}
    env = {
        k: _kubelet_expand(val, downward)
        for k, val in resolved_env(objects, container(objects, "engine")).items()
        if isinstance(val, str)
    }
    assert "$(" not in env["R3_SIDECAR_URL"] and env["R3_ENGINE_ID"] == pod_name
    settings = EngineSettings.model_validate(
        {k.removeprefix("R3_").lower(): val for k, val in env.items() if k.startswith("R3_")}
    )
    rid = "chatcmpl-7f/x y"
    url = httpx.URL(routed_experts_url(settings.sidecar_url, rid))
    expected_host = (
        pod_ip
        if v["sidecar"]["advertise"] == "podIP"
        else (f"{pod_name}.{one(objects, 'StatefulSet')['spec']['serviceName']}.{NAMESPACE}.svc.{v['clusterDomain']}")
    )
    assert (url.host, url.port) == (expected_host, v["sidecar"]["port"])

    write_record(spool, rid, random_rows(6))
    base = serve()
    r = httpx.get(base + url.raw_path.decode(), params={"format": "raw"}, timeout=10)
    assert r.status_code == 200 and unquote(r.headers["X-R3-Rid"]) == rid  # the header is percent-encoded
    assert len(r.content) == 6 * 4 * 8


def test_sidecar_outlives_the_engine_on_termination(rendered: tuple[dict, list]) -> None:
    """The sidecar's preStop holds it up for drainSeconds (inside the grace period) while the engine drains."""
    values, objects = rendered
    v = _values(values)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    command = container(objects, "sidecar")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    assert re.fullmatch(r"import time; time\.sleep\((\d+)\)", command[2]).group(1) == str(v["sidecar"]["drainSeconds"])
    assert v["sidecar"]["drainSeconds"] < pod["terminationGracePeriodSeconds"]
    assert "lifecycle" not in container(objects, "engine")
    with pytest.raises(helm.HelmRenderError, match="drainSeconds must be below"):
        render_manifests({"sidecar": {"drainSeconds": 90}, "terminationGracePeriodSeconds": 60})
    no_drain = render({"sidecar": {"drainSeconds": 0}})
    assert "lifecycle" not in container(no_drain, "sidecar")


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


# ---- names ----------------------------------------------------------------------------------------


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
    if pod.get("serviceAccountName") and _values({})["serviceAccount"]["create"]:
        assert ("ServiceAccount", pod["serviceAccountName"]) in names


# ---- model storage, runtime class, startup ---------------------------------------------------------


def _models_volume(objects: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the pod's `models` volume, the StatefulSet's `models` claim template): one of the two is None."""
    sts = one(objects, "StatefulSet")
    volume = next((v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"), None)
    template = next((t for t in sts["spec"].get("volumeClaimTemplates", []) if t["metadata"]["name"] == "models"), None)
    return volume, template


def test_model_storage_is_mounted_at_hf_home(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    models = v["modelStorage"]
    engine = container(objects, "engine")
    env = resolved_env(objects, engine)
    (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "models"]
    assert mount["mountPath"] == models["mountPath"] == env["HF_HOME"]
    assert mount.get("readOnly", False) == models["readOnly"]
    assert (env.get("HF_HUB_OFFLINE") == "1") == models["readOnly"]
    volume, template = _models_volume(objects)
    assert (volume is None) == (template is not None)
    claims = of_kind(objects, "PersistentVolumeClaim")
    size = f"{models['sizeGiB']}Gi"
    requests = engine["resources"]["requests"]
    scratch = v["engine"]["ephemeralStorageGiB"]
    if models["type"] == "emptyDir":
        assert volume["emptyDir"] == {"sizeLimit": size} and claims == []
        # The weights are node disk: the scheduler must find room for them and the caches.
        assert requests["ephemeral-storage"] == f"{scratch + models['sizeGiB']}Gi"
    else:
        assert requests["ephemeral-storage"] == f"{scratch}Gi"
    if models["type"] == "perPod":
        assert claims == [] and template["spec"]["resources"]["requests"]["storage"] == size
        assert template["spec"]["accessModes"] == models["accessModes"]
    if models["type"] in ("pvc", "existingClaim"):
        claim_name = volume["persistentVolumeClaim"]["claimName"]
        assert volume["persistentVolumeClaim"].get("readOnly", False) == models["readOnly"]
    if models["type"] == "pvc":
        (claim,) = claims
        assert claim["metadata"]["name"] == claim_name
        assert claim["spec"]["resources"]["requests"]["storage"] == size
        assert claim["spec"]["accessModes"] == models["accessModes"]
        assert models["annotations"].items() <= claim["metadata"].get("annotations", {}).items()
        if v["replicaCount"] > 1:
            assert {"ReadWriteMany", "ReadOnlyMany"} & set(claim["spec"]["accessModes"])
    if models["type"] == "existingClaim":
        assert claims == [] and claim_name == models["existingClaim"]
    created = [*claims, *([template] if template else [])]
    for claim in created:
        sc = models["storageClassName"]
        if sc == "":
            assert "storageClassName" not in claim["spec"]  # the cluster's default class
        else:
            assert claim["spec"]["storageClassName"] == ("" if sc == "-" else sc)


def test_model_storage_options_render_as_documented() -> None:
    """Each type, without a values file: what gets created and what fails with a message."""
    for kind in ("perPod", "pvc"):
        objects = render({"modelStorage": {"type": kind, "sizeGiB": 900, "storageClassName": "-"}})
        _, template = _models_volume(objects)
        claim = template if kind == "perPod" else one(objects, "PersistentVolumeClaim")
        assert claim["spec"]["storageClassName"] == "" and claim["spec"]["resources"]["requests"]["storage"] == "900Gi"
        assert resolved_env(objects, container(objects, "engine"))["HF_HOME"] == "/models"
    explicit = render({"engine": {"resources": {"requests": {"ephemeral-storage": "1Ti"}}}})
    assert container(explicit, "engine")["resources"]["requests"]["ephemeral-storage"] == "1Ti"
    none = render({"engine": {"ephemeralStorageGiB": 0}, "modelStorage": {"type": "perPod"}})
    assert "ephemeral-storage" not in container(none, "engine")["resources"]["requests"]
    with pytest.raises(helm.HelmRenderError, match=r"shares one claim between all 3 pods.*ReadWriteMany.*perPod"):
        render_manifests({"replicaCount": 3, "modelStorage": {"type": "pvc"}})
    with pytest.raises(helm.HelmRenderError, match="shares one claim"):
        render_manifests({"replicaCount": 2, "modelStorage": {"type": "pvc", "accessModes": ["ReadWriteOncePod"]}})
    shared = render({"replicaCount": 3, "modelStorage": {"type": "pvc", "accessModes": ["ReadWriteMany"]}})
    assert one(shared, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    with pytest.raises(helm.HelmValuesError, match="existingClaim"):
        render_manifests({"modelStorage": {"type": "existingClaim"}})


def test_runtime_class(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = _values(values)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    if v["runtimeClassName"]:
        assert pod["runtimeClassName"] == v["runtimeClassName"]
    else:
        assert "runtimeClassName" not in pod


def test_startup_probe_allows_a_slow_first_start(rendered: tuple[dict, list]) -> None:
    """Liveness and readiness wait for the startup probe, which allows the configured download-and-load time
    (an hour by default); the kubelet restarts the engine only after that."""
    values, objects = rendered
    v = _values(values)
    startup = container(objects, "engine")["startupProbe"]
    allowed = startup["periodSeconds"] * startup["failureThreshold"]
    assert allowed == v["engine"]["startupProbe"]["periodSeconds"] * v["engine"]["startupProbe"]["failureThreshold"]
    assert allowed >= (3600 if not values.get("engine", {}).get("startupProbe") else 1)
    assert startup["httpGet"]["path"] == "/health"


# ---- readiness: a sidecar fault leaves the engine in the inference Service ------------------------


def test_only_the_engine_decides_whether_the_pod_serves_inference(rendered: tuple[dict, list]) -> None:
    """A pod is in a Service's endpoints when every container with a readiness probe passes it. Only the
    engine has one, so a failing sidecar does not take a healthy engine out of the inference Service;
    trainers reach sidecars through the headless Service, which lists pods whether ready or not."""
    _, objects = rendered
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    gating = [c["name"] for c in [*pod["containers"], *pod.get("initContainers", [])] if "readinessProbe" in c]
    assert gating == ["engine"]
    assert container(objects, "engine")["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http-engine"}
    # Restartable init containers (native sidecars) would count for readiness too: there are none.
    assert all(c.get("restartPolicy") != "Always" for c in pod.get("initContainers", []))
    services = of_kind(objects, "Service")
    sidecar_services = [s for s in services if "http-r3" in {p["targetPort"] for p in s["spec"]["ports"]}]
    assert sidecar_services and all(s["spec"].get("publishNotReadyAddresses") is True for s in sidecar_services)
    inference = [s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") != "None"]
    assert [p["targetPort"] for s in inference for p in s["spec"]["ports"]] == ["http-engine"]
    assert "livenessProbe" in container(objects, "sidecar")  # a hung sidecar is still restarted


# ---- the token under offline rendering (helm template, Argo CD) and against a cluster ----------------

_TOKEN_ERROR = (
    r"auth: set auth\.existingSecret .* or auth\.token, or auth\.enabled=false\. This render cannot see the cluster"
)


def test_offline_render_without_a_token_fails_every_time() -> None:
    """No token, no Secret named, no cluster: a clear failure (twice the same), never a random token."""
    for _ in range(2):
        with pytest.raises(helm.HelmRenderError, match=_TOKEN_ERROR):
            render_manifests({}, raw=True)
    # `helm lint` renders in lint mode, where `fail` only logs: the chart still lints clean on its defaults
    # (chart-testing, Artifact Hub), while `helm template` and `helm install --dry-run` stop.
    report = helm.lint(CHART, {}, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report
    # Turning auth off, or naming the token's source, renders.
    assert of_kind(parse(render_manifests({"auth": {"enabled": False}}, raw=True)), "Secret") == []


def test_offline_renders_are_stable() -> None:
    """What Argo CD does on every sync: render again. The token, and so every object, is identical."""
    for values in ({"auth": {"token": "gitops-token"}}, {"auth": {"existingSecret": "r3-token"}}):
        first, second = render_manifests(values, raw=True), render_manifests(values, raw=True)
        assert first == second
    objects = parse(render_manifests({"auth": {"token": "gitops-token"}}, raw=True))
    assert secret_value(one(objects, "Secret"), "token") == "gitops-token"


def test_against_a_cluster_the_token_is_generated_once_then_kept(tmp_path: Path) -> None:
    """Against a cluster `lookup` can see: a first install draws a token; an upgrade reads it back unchanged."""
    fresh = chart_seeing_cluster(tmp_path / "fresh", [kube_root_ca()])
    installs = [render_manifests({}, raw=True, chart_obj=fresh) for _ in range(2)]
    tokens = [secret_value(one(parse(m), "Secret"), "token") for m in installs]
    assert all(len(t) == 48 and t.isalnum() for t in tokens) and tokens[0] != tokens[1]  # random per install
    assert "generated now, at this install" in installs[0]["r3-sidecar/templates/NOTES.txt"]

    name = one(parse(installs[0]), "Secret")["metadata"]["name"]
    upgraded = chart_seeing_cluster(tmp_path / "upgrade", [kube_root_ca(), secret(name, {"token": tokens[0]})])
    for _ in range(2):
        manifests = render_manifests({}, raw=True, chart_obj=upgraded)
        kept = one(parse(manifests), "Secret")
        assert secret_value(kept, "token") == tokens[0]
        assert kept["metadata"]["annotations"]["r3-sidecar.io/token-source"] == "kept"
        assert "generated at the first install and kept" in manifests["r3-sidecar/templates/NOTES.txt"]
    # A Secret of this name without the key (auth.secretKey changed) is not a token to keep.
    other_key = chart_seeing_cluster(tmp_path / "key", [kube_root_ca(), secret(name, {"bearer": "x"})])
    assert secret_value(one(parse(render_manifests({}, raw=True, chart_obj=other_key)), "Secret"), "token") != "x"
    # The Secret lives in another namespace only: this namespace has none, and no cluster view either.
    elsewhere = chart_seeing_cluster(tmp_path / "ns", [secret(name, {"token": tokens[0]}, namespace="other")])
    with pytest.raises(helm.HelmRenderError, match=_TOKEN_ERROR):
        render_manifests({}, raw=True, chart_obj=elsewhere)


def test_notes_say_where_the_token_comes_from() -> None:
    notes = render_manifests({"auth": {"existingSecret": "r3-token"}}, raw=True)["r3-sidecar/templates/NOTES.txt"]
    assert "Secret r3-token" in notes and "a Secret you manage" in notes
    notes = render_manifests({"auth": {"token": "t"}}, raw=True)["r3-sidecar/templates/NOTES.txt"]
    assert "auth.token as given in the values" in notes
    notes = render_manifests({"auth": {"enabled": False}}, raw=True)["r3-sidecar/templates/NOTES.txt"]
    assert "bearer token" not in notes
