"""The chart as Kubernetes would receive it: rendered by Helm's own Go engine (helm-python-sdk embeds the Helm
v4 SDK), parsed into objects, and the objects validated against pinned published schemas.

Kubernetes kinds use `kubernetes-validate`'s strict OpenAPI schemas for `K8S_VERSION`; the Prometheus
Operator kinds use the CRD schemas vendored in `schemas/` (no PyPI package carries them).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from prometheus_live import RULES_FILE as RULES_FILE  # re-exported: the rules as shipped, beside the chart's copy

from service.server.api import create_app
from service.server.settings import Settings

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "r3-sidecar"
VALUES_DIR = Path(__file__).resolve().parent / "values"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DASHBOARD_FILE = REPO / "deploy" / "grafana" / "r3-sidecar.json"

# The oldest Kubernetes the chart declares (`kubeVersion: >=1.27.0-0`) and a recent one.
K8S_VERSIONS = ("1.27.0", "1.33.0")
RELEASE = "r3"
NAMESPACE = "inference"

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule_v1.json",
}

# An offline render (this one, `helm template`, Argo CD) must say where the sidecar's token comes from: the
# chart refuses to draw a random token it could not read back (templates/_helpers.tpl, r3.authTokenSource).
# Values that leave `auth` out get this fixed token, as a GitOps values file would carry one.
OFFLINE_TOKEN = "offline-render-token-0123456789"

Obj = dict[str, Any]


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def scenario_values(name: str) -> dict[str, Any]:
    """Values of `values/<name>.yaml`, parsed by Helm itself (`-f` semantics); `defaults` is no file."""
    if name == "defaults":
        return {}
    return helm.values_from_yaml((VALUES_DIR / f"{name}.yaml").read_text())


def scenarios() -> list[str]:
    return ["defaults", *sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))]


def offline(values: dict[str, Any] | None) -> dict[str, Any]:
    """`values` plus `auth.token: OFFLINE_TOKEN` when they do not mention `auth` at all."""
    values = copy.deepcopy(values or {})
    if "auth" not in values:
        values["auth"] = {"token": OFFLINE_TOKEN}
    return values


def render_manifests(
    values: dict[str, Any] | None = None, *, release: str = RELEASE, raw: bool = False, chart_obj: Any = None
) -> dict[str, str]:
    """Template path → rendered text, as `helm template <release> … -n inference` produces it.

    `raw=True` renders `values` exactly as given (no OFFLINE_TOKEN), to see what an operator without one sees.
    """
    c = chart_obj or chart()
    return c.render(values or {} if raw else offline(values), name=release, namespace=NAMESPACE, is_install=True)


def parse(manifests: dict[str, str]) -> list[Obj]:
    """Every Kubernetes object of rendered manifests (NOTES.txt excluded), in template order."""
    objects: list[Obj] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE) -> list[Obj]:
    """Every Kubernetes object the chart renders (NOTES.txt excluded), in template order."""
    return parse(render_manifests(values, release=release))


@functools.cache
def rendered_scenario(name: str) -> tuple[dict[str, Any], list[Obj]]:
    """A scenario's values and every object they render, rendered once per process: the chart's test modules
    each check every scenario (tests/deploy/conftest.py's `rendered`), and Helm's render is the costly part.
    Shared objects: a test that changes one must change a copy."""
    values = scenario_values(name)
    return values, render(values)


def effective_values(values: dict[str, Any]) -> dict[str, Any]:
    """The values Helm actually uses: chart defaults coalesced with the scenario (as rendered, see `offline`)."""
    return helm.Chart.load(CHART).merge_values(offline(values))


def sidecar_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the real sidecar app serves: what the chart's probes, monitors and notes
    may name."""
    app = create_app(Settings(spool_dir=Path("/nonexistent-r3-spool")))
    return {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}


# ---- a cluster `lookup` can see ------------------------------------------------------------------

_LOOKUP = re.compile(r"\(lookup ((?:\"[^\"]*\"|[.$\w]+)(?: (?:\"[^\"]*\"|[.$\w]+)){3})\)")


def chart_seeing_cluster(dest: Path, cluster: list[Obj]) -> helm.Chart:
    """A copy of the chart whose `lookup` calls answer from `cluster` (objects), as a live API server would.

    Helm's SDK renders offline only, where `lookup` returns nothing. The copy rewrites every
    `(lookup "v1" "Kind" ns name)` into a call of a template that returns the matching object of `cluster`
    (or an empty dict, as `lookup` does for a missing object); the chart writes every `lookup` that way, and
    the copy asserts that none is left unrewritten.
    """
    copy_dir = dest / CHART.name
    shutil.copytree(CHART, copy_dir, symlinks=False)
    for tpl in (copy_dir / "templates").rglob("*"):
        if tpl.suffix not in (".yaml", ".tpl", ".txt"):
            continue
        text = tpl.read_text()
        text = _LOOKUP.sub(lambda m: f'(fromYaml (include "fake.lookup" (list {m.group(1)})))', text)
        assert "lookup " not in text.replace('"fake.lookup"', ""), f"{tpl.name}: a lookup the fake cannot answer"
        tpl.write_text(text)
    table = {f"{o['apiVersion']}/{o['kind']}/{o['metadata']['namespace']}/{o['metadata']['name']}": o for o in cluster}
    (copy_dir / "templates" / "_fake_lookup.tpl").write_text(
        '{{- define "fake.lookup" -}}\n'
        "{{- $cluster := fromJson " + json.dumps(json.dumps(table)) + " }}\n"
        '{{- $key := printf "%s/%s/%s/%s" (index . 0) (index . 1) (index . 2) (index . 3) }}\n'
        "{{- with get $cluster $key }}{{ toYaml . }}{{ else }}{}{{ end }}\n"
        "{{- end }}\n"
    )
    return helm.Chart.load(copy_dir)


def kube_root_ca(namespace: str = NAMESPACE) -> Obj:
    """The ConfigMap the kube-controller-manager publishes into every namespace."""
    meta = {"name": "kube-root-ca.crt", "namespace": namespace}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"ca.crt": "-----BEGIN…"}}


def secret(name: str, data: dict[str, str], namespace: str = NAMESPACE) -> Obj:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[Obj], kind: str, *, hook: bool | None = None) -> Obj:
    found = [o for o in of_kind(objects, kind) if hook is None or is_hook(o) == hook]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def is_hook(obj: Obj) -> bool:
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def validate(obj: Obj, k8s_version: str) -> None:
    """Raise when `obj` does not match its kind's published schema (unknown kinds raise too)."""
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft7Validator(schema).validate(obj)
        return
    kubernetes_validate.validate(obj, k8s_version, strict=True)


def container(objects: list[Obj], name: str) -> Obj:
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    return next(c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == name)


def resolved_env(objects: list[Obj], ctr: Obj) -> dict[str, Any]:
    """The container's environment as the kubelet assembles it: `envFrom` ConfigMaps, then `env` (which wins).

    Plain values are strings; `valueFrom` entries are kept as their source dict.
    """
    env: dict[str, Any] = {}
    configmaps = {c["metadata"]["name"]: c for c in of_kind(objects, "ConfigMap")}
    for source in ctr.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in ctr.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else var["valueFrom"]
    return env


def secret_value(secret: Obj, key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def quantity_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity with a binary suffix (the chart writes `<n>Mi`)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)
