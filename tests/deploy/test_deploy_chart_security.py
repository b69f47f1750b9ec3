"""Who may run, reach and take down the chart's pods: security contexts and Pod Security `restricted`, the
disruption budget, the network policy, and the sidecar's token (from a Secret the chart renders, one an operator
names, or one drawn at install against a cluster) with what the install notes say of it (scenarios: `rendered`,
tests/deploy/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
from deploy_render import (
    CHART,
    NAMESPACE,
    OFFLINE_TOKEN,
    chart_seeing_cluster,
    container,
    effective_values,
    kube_root_ca,
    of_kind,
    one,
    parse,
    render,
    render_manifests,
    resolved_env,
    secret,
    secret_value,
    sidecar_routes,
)
from pod_security import restricted_violations

# ---- security and disruption ----------------------------------------------------------------------


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
    assert env["USER"] and env["HOME"] == effective_values({})["engine"]["home"]
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
    v = effective_values(values)
    pdbs = of_kind(objects, "PodDisruptionBudget")
    if not v["podDisruptionBudget"]["enabled"]:
        assert pdbs == []
        return
    (pdb,) = pdbs
    pod_labels = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == v["podDisruptionBudget"]["maxUnavailable"]
    assert all(pod_labels[k] == val for k, val in pdb["spec"]["selector"]["matchLabels"].items())


def test_network_policy_limits_the_sidecar_port_to_trainers(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = effective_values(values)
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


# ---- auth -----------------------------------------------------------------------------------------


def test_the_secret_reaches_r3_auth_token(rendered: tuple[dict, list]) -> None:
    values, objects = rendered
    v = effective_values(values)
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


def test_notes_tell_how_to_fetch_a_rid() -> None:
    notes = render_manifests()["r3-sidecar/templates/NOTES.txt"]
    assert "/routed_experts/<rid>" in notes and "Authorization: Bearer" in notes and "helm test" in notes
    from service.server.cli import build_parser

    (exec_line,) = [line for line in notes.splitlines() if "kubectl exec" in line]
    args = build_parser().parse_args(exec_line.split(" -- ", 1)[1].split()[1:])
    assert args.command == "fetch" and args.url == f"http://127.0.0.1:{effective_values({})['sidecar']['port']}"
    assert ("GET", "/routed_experts/{rid:path}") in sidecar_routes()
    notes_off = render_manifests({"auth": {"enabled": False}})["r3-sidecar/templates/NOTES.txt"]
    assert "Authorization" not in notes_off and "/routed_experts/<rid>" in notes_off


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
