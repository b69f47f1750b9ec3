"""Alert rules and the Grafana dashboard against a live sidecar's /metrics and a real PromQL parser.

Every expression parses (promql-parser, the Rust port of Prometheus' parser); every series it selects
exists on a real sidecar after an engine file and a few fetches; every label it matches, groups by, or
prints in an annotation is a label that series carries or one Prometheus adds to every scraped target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import promql_parser as pp
import pytest
import yaml
from deploy_render import DASHBOARD_FILE, RULES_FILE
from helpers import engine_report, random_rows, write_record
from prometheus_client.parser import text_string_to_metric_families

from service.spool import Spool

# Labels the Prometheus Operator's ServiceMonitor puts on every sample of a target.
TARGET_LABELS = frozenset({"namespace", "pod", "service", "endpoint", "container", "job", "instance"})
# Series Prometheus itself writes for every target (scrape health), not the sidecar.
SCRAPE_SERIES = {"up": frozenset(), "scrape_duration_seconds": frozenset()}
# Series a rule may select before any component exports them: the rule must stay silent until then.
FUTURE_SERIES = {"r3_engine_undelivered_total": frozenset({"engine", "reason"})}  # issue 12 adds it
# Grafana variables, replaced by what Grafana would put there before the query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "30s", "$namespace": ".*", "$pod": ".*"}

RULES = yaml.safe_load(RULES_FILE.read_text())
ALERTS = {r["alert"]: r for g in RULES["groups"] for r in g["rules"] if "alert" in r}
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())


def dashboard_targets() -> Iterator[tuple[str, str]]:
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(DASHBOARD["panels"]):
        for t in p.get("targets", []):
            yield p["title"], t["expr"]


def grafana_expand(expr: str) -> str:
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(var, GRAFANA_VARS[var])
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


EXPRESSIONS = [(f"alert {name}", rule["expr"]) for name, rule in ALERTS.items()] + [
    (f"panel {title}", grafana_expand(expr)) for title, expr in dashboard_targets()
]


@dataclass
class Usage:
    """What one expression asks of the metrics: selected series and the labels it names."""

    selectors: list[pp.VectorSelector] = field(default_factory=list)
    group_labels: list[tuple[str, frozenset[str]]] = field(default_factory=list)  # (label, series names under it)
    aggregated: bool = False
    by_labels: set[str] = field(default_factory=set)


def usage(expr: str) -> Usage:
    found = Usage()

    def names_under(node: pp.Expr) -> frozenset[str]:
        names: set[str] = set()

        def visit(n: pp.Expr) -> None:
            if isinstance(n, pp.VectorSelector) and n.name:
                names.add(n.name)

        pp.walk(node, visit)
        return frozenset(names)

    def visit(node: pp.Expr) -> None:
        if isinstance(node, pp.VectorSelector):
            found.selectors.append(node)
        elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            found.aggregated = True
            under = names_under(node.expr)
            for label in node.modifier.labels:
                found.group_labels.append((label, under))
                found.by_labels.add(label)

    pp.walk(pp.parse(expr), visit)
    return found


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sample name → label names, scraped from a real sidecar after the traffic every series needs."""
    from helpers import live_server

    from service.server.settings import Settings

    root = tmp_path_factory.mktemp("spool")
    spool = Spool(root)
    spool.write_engine(engine_report("pod-a/dp0"))
    failed = {"hook": "on_forward_end", "target": "ModelRunner.forward", "error": "KeyError: 3", "since": 1.0}
    spool.write_engine({**engine_report("pod-a/dp1"), "degraded": [failed]})  # r3_engine_degraded_hooks_total
    write_record(spool, "rid-ok", random_rows(16))
    write_record(spool, "rid-open", random_rows(2), final=False)
    with live_server(Settings(spool_dir=root, spool_max_bytes=1 << 24)) as base:
        assert httpx.get(f"{base}/routed_experts/rid-ok", timeout=10).status_code == 200
        assert httpx.get(f"{base}/routed_experts/rid-none", params={"format": "raw"}, timeout=10).status_code == 404
        text = httpx.get(f"{base}/metrics", timeout=10).text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    for name, labels in {**SCRAPE_SERIES, **FUTURE_SERIES}.items():
        series.setdefault(name, set(labels))
    return series


def test_every_expression_parses() -> None:
    assert len(EXPRESSIONS) >= 20
    for where, expr in EXPRESSIONS:
        try:
            pp.parse(expr)
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}: {expr}")


def test_the_parser_rejects_broken_promql() -> None:
    broken_exprs = ("rate(r3_served_total[5m]", "r3_budget_ok ==", "sum by (engine (r3_budget_ok)", "r3_bytes{pod=}")
    for broken in broken_exprs:
        with pytest.raises(ValueError):
            pp.parse(broken)


def test_series_and_labels_exist_on_a_live_sidecar(live_metrics: dict[str, set[str]]) -> None:
    assert "r3_fetch_seconds_bucket" in live_metrics and "r3_served_total" in live_metrics
    for where, expr in EXPRESSIONS:
        use = usage(expr)
        assert use.selectors, f"{where} selects nothing"
        for sel in use.selectors:
            assert sel.name in live_metrics, f"{where}: no series {sel.name} on /metrics"
            assert sel.name.startswith("r3_") or sel.name in SCRAPE_SERIES, f"{where}: {sel.name} is not an r3_ name"
            for matcher in sel.matchers.matchers:
                known = live_metrics[sel.name] | TARGET_LABELS
                assert matcher.name in known, f"{where}: {sel.name} has no label {matcher.name}"
        for label, names in use.group_labels:
            known = set(TARGET_LABELS).union(*(live_metrics[n] for n in names))
            assert label in known, f"{where}: grouping by {label}, which {sorted(names)} do not carry"


def test_label_values_the_rules_match_are_real(live_metrics: dict[str, set[str]]) -> None:
    """The labels the rules filter and group on are on the series."""
    assert {"code", "format"} <= live_metrics["r3_served_total"]
    assert {"engine", "buffer"} <= live_metrics["r3_buffer_headroom_ratio"]
    assert "le" in live_metrics["r3_fetch_seconds_bucket"]


def test_code_matchers_select_the_codes_the_sidecar_emits(tmp_path) -> None:
    """`code` holds HTTP status numbers: the rules' and panels' `code` regexes (fully anchored, as Prometheus
    applies them) pick out exactly the answers they are named for."""
    from helpers import live_server

    from service.server.settings import Settings

    spool = Spool(tmp_path / "spool")
    write_record(spool, "there", random_rows(4))
    with live_server(Settings(spool_dir=spool.root)) as base:
        assert httpx.get(f"{base}/routed_experts/there", timeout=10).status_code == 200
        assert httpx.get(f"{base}/routed_experts/none", timeout=10).status_code == 404
        text = httpx.get(f"{base}/metrics", timeout=10).text
    codes = {
        s.labels["code"] for f in text_string_to_metric_families(text) for s in f.samples if s.name == "r3_served_total"
    }
    assert codes == {"200", "404"}
    codes |= {"500", "abort", "410", "499"}  # what a failing spool, a cut body, a gone record, a leaving client add
    selected: dict[str, set[str]] = {}
    for where, expr in EXPRESSIONS:
        for sel in usage(expr).selectors:
            for m in sel.matchers.matchers:
                if m.name == "code":
                    selected[f"{where} {m.op} {m.value}"] = {c for c in codes if _matches(m, c)}
    assert selected == {
        "alert R3FetchServerErrors MatchOp.Re 5..|abort": {"500", "abort"},
        "alert R3FetchRecordsMissing MatchOp.Equal 404": {"404"},
        "panel Fetch errors MatchOp.Re 5..|abort": {"500", "abort"},
        "panel Fetch errors MatchOp.Re 4..": {"404", "410", "499"},
    }, selected


def _matches(matcher: pp.Matcher, value: str) -> bool:
    if matcher.op == pp.MatchOp.Equal:
        return value == matcher.value
    if matcher.op == pp.MatchOp.NotEqual:
        return value != matcher.value
    hit = re.fullmatch(matcher.value, value) is not None
    return hit if matcher.op == pp.MatchOp.Re else not hit


def test_alert_annotations_name_labels_the_alert_keeps(live_metrics: dict[str, set[str]]) -> None:
    for name, rule in ALERTS.items():
        use = usage(rule["expr"])
        if use.aggregated:
            kept = use.by_labels
        else:
            kept = set(TARGET_LABELS).union(*(live_metrics[s.name] for s in use.selectors))
        for text in rule["annotations"].values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert label in kept, f"{name}: annotation uses $labels.{label}, the result has only {sorted(kept)}"


def test_alerts_cover_the_operational_risks() -> None:
    """Each risk the deployment must page on has an alert over the right series, threshold and duration."""

    def alert_on(series: str) -> list[dict[str, Any]]:
        return [r for r in ALERTS.values() if any(s.name == series for s in usage(r["expr"]).selectors)]

    (headroom,) = alert_on("r3_buffer_headroom_ratio")
    assert headroom["for"] == "5m" and re.search(r"<\s*0\.10?\b", headroom["expr"])
    (budget,) = alert_on("r3_budget_ok")
    assert re.search(r"==\s*0\b", budget["expr"]) and budget["labels"]["severity"] == "critical"
    (spool,) = alert_on("r3_spool_bytes")
    assert "r3_spool_capacity_bytes" in spool["expr"] and re.search(r">\s*0\.90?\b", spool["expr"])
    (fallback,) = alert_on("r3_engine_fallback_inline_total")
    assert "rate(r3_engine_fallback_inline_total[" in fallback["expr"]
    absent_engine, stale = sorted(alert_on("r3_engine_stale"), key=lambda r: r["alert"])
    assert "== 1" in stale["expr"] and " unless " in absent_engine["expr"]
    (degraded,) = alert_on("r3_engine_degraded_hooks_total")
    assert "hook" in degraded["expr"] and degraded["for"] == "0s"  # a failed hook stays failed: page at once
    (suspect,) = alert_on("r3_engine_suspect_records_total")
    assert "increase(r3_engine_suspect_records_total[" in suspect["expr"] and suspect["for"] == "0s"
    assert suspect["labels"]["severity"] == "critical"  # wrong routes crash nothing: this is the one sign
    (undelivered,) = alert_on("r3_engine_undelivered_total")
    assert "rate(r3_engine_undelivered_total[" in undelivered["expr"] and "reason" in undelivered["expr"]
    (down,) = alert_on("up")
    assert re.search(r"up\s*==\s*0", down["expr"]) and down["labels"]["severity"] == "critical"
    assert any(r["expr"].startswith("absent(r3_") for r in ALERTS.values()), "no alert for sidecars gone from discovery"
    assert "r3_budget_demand" in headroom["expr"] and "r3_budget_capacity" in headroom["expr"]
    fetch = alert_on("r3_served_total")
    assert len(fetch) == 2 and all("/" in r["expr"] for r in fetch), "fetch alerts are error ratios"
    for name, rule in ALERTS.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert {"summary", "description"} <= rule["annotations"].keys(), name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name


def test_dashboard_panels_cover_what_operators_watch() -> None:
    used = {sel.name: title for title, expr in dashboard_targets() for sel in usage(grafana_expand(expr)).selectors}
    for series in (
        "r3_buffer_headroom_ratio",
        "r3_budget_capacity",
        "r3_budget_demand",
        "r3_spool_bytes",
        "r3_spool_capacity_bytes",
        "r3_served_total",
        "r3_served_bytes_total",
        "r3_fetch_seconds_bucket",
        "r3_engine_fallback_inline_total",
    ):
        assert series in used, f"no panel shows {series}"
    quantiles = [e for _, e in dashboard_targets() if e.startswith("histogram_quantile(")]
    assert {re.match(r"histogram_quantile\(([\d.]+)", q).group(1) for q in quantiles} >= {"0.5", "0.9", "0.99"}


def test_dashboard_is_importable_by_grafana() -> None:
    assert DASHBOARD["uid"] == "r3-sidecar" and DASHBOARD["schemaVersion"] >= 36
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = []
    for title, _ in dashboard_targets():
        assert title
    for panel in DASHBOARD["panels"]:
        ids.append(panel["id"])
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(t["refId"] for t in panel["targets"])
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
    assert len(ids) == len(set(ids))
    # No two panels overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & area, panel["title"]
        cells |= area


PROMTOOL_TESTS = RULES_FILE.parents[2] / "tests" / "deploy" / "promtool" / "r3-sidecar-rules.test.yaml"


def _promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


@pytest.mark.skipif(_promtool() is None, reason="promtool not installed (Debian package `prometheus`; or set PROMTOOL)")
def test_alerts_fire_as_specified_under_promtool() -> None:
    """Prometheus' own rule engine: each alert fires on its failing series only, after its `for`, with the
    labels and rendered annotations written in tests/deploy/promtool/r3-sidecar-rules.test.yaml."""
    check = subprocess.run([_promtool(), "check", "rules", RULES_FILE], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f"SUCCESS: {len(ALERTS)} rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([_promtool(), "test", "rules", PROMTOOL_TESTS], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_promtool_unit_tests_cover_every_alert() -> None:
    spec = yaml.safe_load(PROMTOOL_TESTS.read_text())
    firing = {case["alertname"] for test in spec["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert firing == set(ALERTS)
    assert (PROMTOOL_TESTS.parent / spec["rule_files"][0]).resolve() == RULES_FILE.resolve()
