"""The Helm chart, rendered by Helm's Go engine, linted strictly, and checked object by object.

Each scenario is a values file under `values/` (plus the chart defaults): 1 and 8 replicas, monitoring on and
off, auth with a fixed, generated or existing token, network policy, pod-IP addressing.
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
    RULES_FILE,
    container,
    is_hook,
    of_kind,
    one,
    quantity_bytes,
    render,
    render_manifests,
    resolved_env,
    scenario_values,
    scenarios,
    secret_value,
    validate,
)

from service.api import create_app
from service.settings import Settings
from service.spool import Spool

SCENARIOS = scenarios()


@pytest.fixture(scope="module", params=SCENARIOS)
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = scenario_values(request.param)
    return values, render(values)


def _values(values: dict[str, Any]) -> dict[str, Any]:
    """The values Helm actually uses: chart defaults coalesced with the scenario."""
    return helm.Chart.load(CHART).merge_values(values)


# ---- Helm's own checks ------------------------------------------------------------------------------


def test_scenarios_cover_the_brief() -> None:
    assert {"defaults", "replicas-8", "monitoring-on", "network-policy", "auth-fixed-token"} <= set(SCENARIOS)
    assert "replicas-1-monitoring-off-auth-off" in SCENARIOS


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict_is_clean(scenario: str) -> None:
    report = helm.lint(CHART, scenario_values(scenario), strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
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
    sts["spec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    monitor = json.loads(json.dumps(one(objects, "ServiceMonitor")))
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

    headless = next(s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") == "None")
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
    if v["auth"]["token"]:
        assert token == v["auth"]["token"]
    else:
        assert len(token) == 48 and token.isalnum()
    assert "R3_AUTH_TOKEN" not in {e["name"] for e in container(objects, "engine")["env"]}


def test_a_generated_token_is_random_per_install() -> None:
    """Offline, `lookup` finds nothing, so each render draws a new token; in a cluster the existing one wins."""
    tokens = {secret_value(one(render(), "Secret"), "token") for _ in range(3)}
    assert len(tokens) == 3
    assert 'lookup "v1" "Secret"' in (CHART / "templates" / "secret.yaml").read_text()


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
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe"):
        get = sidecar[probe]["httpGet"]
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
    for probe in ("livenessProbe", "readinessProbe"):
        r = httpx.get(base + sidecar[probe]["httpGet"]["path"], timeout=5)
        assert r.status_code == 200, (probe, r.text)
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
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for name in ("spool-init", "engine", "sidecar"):
        ctx = container(objects, name)["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"]
    for name in ("spool-init", "sidecar"):
        ctx = container(objects, name)["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["readOnlyRootFilesystem"] is True and ctx["runAsUser"] > 0
    # Engine and sidecar share the spool through the pod's fsGroup.
    assert pod["securityContext"]["fsGroup"] == container(objects, "sidecar")["securityContext"]["runAsGroup"]
    for name in ("engine", "sidecar"):
        assert container(objects, name)["resources"]["limits"]["memory"]


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
    monitors = of_kind(objects, "ServiceMonitor")
    rules = of_kind(objects, "PrometheusRule")
    dashboards = [c for c in of_kind(objects, "ConfigMap") if "r3-sidecar.json" in c.get("data", {})]
    assert len(monitors) == int(v["serviceMonitor"]["enabled"])
    assert len(rules) == int(v["prometheusRule"]["enabled"])
    assert len(dashboards) == int(v["grafanaDashboard"]["enabled"])
    for monitor in monitors:
        (endpoint,) = monitor["spec"]["endpoints"]
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        selected = [s for s in of_kind(objects, "Service") if wanted <= s["metadata"]["labels"].items()]
        assert len(selected) == 1 and selected[0]["spec"]["clusterIP"] == "None"
        assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
        assert endpoint["path"] == "/metrics" and ("GET", "/metrics") in _app_routes()
        assert v["serviceMonitor"]["labels"].items() <= monitor["metadata"]["labels"].items()
    for rule in rules:
        assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    for dashboard in dashboards:
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["r3-sidecar.json"]) == json.loads(DASHBOARD_FILE.read_text())


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
    assert by_port["http-engine"].get("from", []) == v["networkPolicy"]["enginePeers"]


def test_hooks_are_only_the_test_pod(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    assert [o["kind"] for o in objects if is_hook(o)] == ["Pod"]


def test_notes_tell_how_to_fetch_a_rid() -> None:
    notes = render_manifests()["r3-sidecar/templates/NOTES.txt"]
    assert "/routed_experts/<rid>" in notes and "Authorization: Bearer" in notes and "helm test" in notes
    from service.cli import build_parser

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
    out[scenario] = {k: getattr(ns, k) for k in ("model_path", "port", "tp_size", "enable_return_routed_experts")}
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
        }, scenario


def test_sidecar_command_line_parses_with_the_real_cli(rendered: tuple[dict, list]) -> None:
    from service.cli import build_parser

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

    from engine_ext.collect import routed_experts_url
    from engine_ext.settings import EngineSettings

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
