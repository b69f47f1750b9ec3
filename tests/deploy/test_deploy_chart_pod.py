"""The chart's pod, scenario by scenario (`rendered`, tests/deploy/conftest.py): the spool both containers
share and the settings that point at it, the addresses the engine advertises, the probes and the helm test
against the real sidecar app, model storage, the runtime class, the slow first start, who decides readiness,
and the order in which the containers stop.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from deploy_render import (
    NAMESPACE,
    container,
    effective_values,
    of_kind,
    one,
    quantity_bytes,
    render,
    render_manifests,
    resolved_env,
    sidecar_routes,
)

from service.server.settings import Settings
from service.spool import Spool

# ---- the pod: spool, settings, addressing ---------------------------------------------------------


def test_both_containers_share_the_spool_where_the_settings_point(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = effective_values(values)
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
    v = effective_values(values)
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
    v = effective_values(values)
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
    v = effective_values(values)
    engine = container(objects, "engine")
    service = next(s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") != "None")
    (port,) = service["spec"]["ports"]
    assert port["port"] == v["service"]["port"]
    assert {p["name"]: p["containerPort"] for p in engine["ports"]}[port["targetPort"]] == v["engine"]["port"]
    gpus = engine["resources"]["limits"][v["engine"]["gpuResourceName"]]
    assert gpus == engine["resources"]["requests"][v["engine"]["gpuResourceName"]] == str(v["engine"]["gpus"])


# ---- probes and the helm test against the real app ----------------------------------------------


def test_probes_hit_routes_the_sidecar_serves(rendered: tuple[dict, list]) -> None:
    _, objects = rendered
    routes = sidecar_routes()
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
    v = effective_values(values)
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


# ---- model storage, runtime class, startup ---------------------------------------------------------


def _models_volume(objects: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the pod's `models` volume, the StatefulSet's `models` claim template): one of the two is None."""
    sts = one(objects, "StatefulSet")
    volume = next((v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"), None)
    template = next((t for t in sts["spec"].get("volumeClaimTemplates", []) if t["metadata"]["name"] == "models"), None)
    return volume, template


def test_model_storage_is_mounted_at_hf_home(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = effective_values(values)
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
    v = effective_values(values)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    if v["runtimeClassName"]:
        assert pod["runtimeClassName"] == v["runtimeClassName"]
    else:
        assert "runtimeClassName" not in pod


def test_startup_probe_allows_a_slow_first_start(rendered: tuple[dict, list]) -> None:
    """Liveness and readiness wait for the startup probe, which allows the configured download-and-load time
    (an hour by default); the kubelet restarts the engine only after that."""
    values, objects = rendered
    v = effective_values(values)
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


# ---- termination ----------------------------------------------------------------------------------


def test_sidecar_outlives_the_engine_on_termination(rendered: tuple[dict, list]) -> None:
    """The sidecar's preStop holds it up for drainSeconds (inside the grace period) while the engine drains."""
    values, objects = rendered
    v = effective_values(values)
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
