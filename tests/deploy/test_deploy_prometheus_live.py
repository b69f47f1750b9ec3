"""Every alert and every dashboard query against a real Prometheus server scraping live sidecars.

One scenario, shared by the tests below (about two minutes on a quiet machine):
1. Prometheus (1 s scrape and evaluation) loads the rule file and the chart-rendered PrometheusRule, each
   with `for:` shortened to `FOR` (expressions untouched). It scrapes two `r3-sidecar demo` processes
   (pods r3-0, r3-1) while trainer threads fetch (single, stream, batch) and acknowledge their records.
2. Healthy baseline, `BASELINE_S`: no alert may go pending.
3. Provoke: pod r3-2, an `r3-sidecar serve` over a spool this test writes, joins with no engine file
   (telemetry absent); then engine files with an unmet budget, a buffer at 95% that its budget does not
   cover beside a full buffer that it does (must stay quiet), rising fallbacks, a stale engine; a record
   whose `.bin` is a directory fetched over and over (5xx), unknown rids (404), a nearly full spool; a
   stand-in exporter for `r3_engine_undelivered_total`. Every dashboard query is run while all exist.
4. Pod r3-1 is killed (sidecar down); then every sidecar (metrics absent).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from deploy_render import DASHBOARD_FILE, RULES_FILE, render
from helpers import random_rows, stop_process, write_record
from prometheus_live import CounterExporter, Prometheus, prometheus_binary, shorten_for, sidecar
from waiting import WaitTimeout, wait_until

from service.spool import Spool

FOR = "3s"
# The demo pods keep a record `DEMO_TTL_S` after it finishes; the baseline is long enough that the warm-up's
# records expire inside it, so retention sweeps (the dense engine's records, which no trainer fetches) while every
# rule is watched: `test_healthy_baseline_fires_nothing` asserts each pod expired records in it.
DEMO_TTL_S = 30
BASELINE_S = float(os.environ.get("R3_PROM_BASELINE_S", "75"))  # shorter only to iterate locally
ALERT_TIMEOUT_S = 60.0
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$namespace": ".*", "$pod": ".*"}
RULES = yaml.safe_load(RULES_FILE.read_text())
ALERTS = [r["alert"] for g in RULES["groups"] for r in g["rules"] if "alert" in r]

# In CI (.ci/run fetches the server) this skip is a failure naming it, as every skip there (tests/skips.py).
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        prometheus_binary() is None,
        reason="no Prometheus server binary (Debian package `prometheus`; .ci/run fetches it; or set PROMETHEUS)",
    ),
]


@dataclass
class Repeats:
    """What `repeating` saw: how often its action ran, and how each failure read (an assert in it included)."""

    runs: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class Observed:
    """What the scenario saw, for the tests to judge."""

    baseline_s: float = 0.0
    baseline_active: list[tuple[str, str, str, dict[str, str]]] = field(default_factory=list)
    baseline_expired: dict[str, float] = field(default_factory=dict)  # pod → records retention deleted in it
    # (file, alert) → seconds from its provocation to first pending / firing, and the labels it fired with
    pending_s: dict[tuple[str, str], float] = field(default_factory=dict)
    firing_s: dict[tuple[str, str], float] = field(default_factory=dict)
    firing_labels: dict[tuple[str, str], list[dict[str, str]]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    rule_files: list[str] = field(default_factory=list)
    panel_results: dict[str, int] = field(default_factory=dict)
    fetch_codes: dict[str, int] = field(default_factory=dict)
    # the provoking loops: bad fetches (each asserts its 500 and 404) and engine-file refreshes
    bad_fetches: Repeats = field(default_factory=Repeats)
    engine_writes: Repeats = field(default_factory=Repeats)


class Trainer(threading.Thread):
    """Fetches and acknowledges a demo sidecar's records in order, as a trainer would: whole records,
    streams and batches, each answer's status tallied."""

    def __init__(self, base: str, stop_event: threading.Event) -> None:
        super().__init__(daemon=True, name=f"r3-test-trainer-{base}")
        self.base, self.stop_event = base, stop_event
        self.codes: dict[str, int] = {}

    def run(self) -> None:
        i = 0
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self.stop_event.is_set():
                rid = f"demo-{i:06d}"
                try:
                    if i % 7 == 3:
                        r = client.post("/routed_experts/batch", json={"rids": [rid], "wait": 30})
                    elif i % 5 == 1:
                        r = client.get(f"/routed_experts/{rid}", params={"stream": "true", "wait": 30})
                    else:
                        r = client.get(f"/routed_experts/{rid}", params={"wait": 30, "format": "raw"})
                    if r.status_code != 202:  # 202: not final within the wait, ask again
                        client.delete(f"/routed_experts/{rid}")
                        i += 1
                except httpx.HTTPError:
                    self.stop_event.wait(0.5)  # the sidecar is gone (the scenario killed it)
                    continue
                self.codes[str(r.status_code)] = self.codes.get(str(r.status_code), 0) + 1


class Watcher:
    """Polls Prometheus' alert states; remembers when each (file, alert) first went pending and firing."""

    def __init__(self, prom: Prometheus, obs: Observed) -> None:
        self.prom, self.obs = prom, obs
        self.since: dict[str, float] = {}

    def provoke(self, *alerts: str) -> None:
        now = time.monotonic()
        for a in alerts:
            self.since[a] = now

    def poll(self) -> list[tuple[str, str, str, dict[str, str]]]:
        active = self.prom.active_alerts()
        now = time.monotonic()
        for file, name, state, labels in active:
            key = (Path(file).name, name)
            if name not in self.since:
                self.obs.unexpected.append(f"{key} {state} {labels}")
                continue
            elapsed = now - self.since[name]
            self.obs.pending_s.setdefault(key, elapsed)
            if state == "firing":
                self.obs.firing_s.setdefault(key, elapsed)
                self.obs.firing_labels.setdefault(key, [])
                if labels not in self.obs.firing_labels[key]:
                    self.obs.firing_labels[key].append(labels)
        return active

    def until_firing(self, alerts: list[str], files: list[str], timeout: float = ALERT_TIMEOUT_S) -> None:
        def all_firing() -> bool:
            self.poll()
            return all((f, a) in self.obs.firing_s for f in files for a in alerts)

        # a miss is not this scenario's failure: the per-alert tests name each alert that never fired
        with contextlib.suppress(WaitTimeout):
            wait_until(all_firing, timeout, f"{alerts} firing from {files}", interval=0.25)


def engine_file(engine: str, updated: float, fallback: int) -> dict[str, Any]:
    """An engine file (Contract 1): `device_cache` full to capacity but covered by its budget (a full
    prefill chunk: must not page), `host_cache` at 95% with capacity below demand (must page)."""
    return {
        "engine": engine,
        "dp_rank": 0,
        "pid": 1,
        "sglang": "test",
        "updated": updated,
        "budget": [
            {"buffer": "device_cache", "unit": "rows", "capacity": 8192, "demand": 8192, "ok": True, "formula": "P"},
            {"buffer": "host_cache", "unit": "tokens", "capacity": 1000, "demand": 2000, "ok": False, "formula": "K"},
        ],
        "occupancy": [
            {"buffer": "device_cache", "capacity": 8192, "peak": 8192, "window_s": 1},
            {"buffer": "host_cache", "capacity": 1000, "peak": 950, "window_s": 1},
        ],
        "host_cache": {"capacity_tokens": 1000, "used_tokens": 950},
        "writer": {
            "queued_bytes": 0,
            "records_written": 1,
            "fallback_inline": fallback,
            "spool_full": 0,
            "suspect_records": fallback,  # rises with the fallbacks: R3SuspectRecords fires on dp0 only
        },
    }


@contextlib.contextmanager
def repeating(action: Callable[[], None], period_s: float, seen: Repeats) -> Iterator[None]:
    """Run `action` every `period_s` on a thread until the block ends. A failure does not stop the loop (the
    scenario goes on to its other alerts) but is kept in `seen`, which a test asserts empty: an action's own
    asserts must be able to fail the run."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(period_s):
            seen.runs += 1
            try:
                action()
            except Exception as exc:  # kept, judged by a test
                first_line = (str(exc).splitlines() or [""])[0]
                seen.failures.append(f"{type(exc).__name__}: {first_line}")

    thread = threading.Thread(target=loop, daemon=True, name="r3-test-repeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)


def grafana_expand(expr: str) -> str:
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(var, GRAFANA_VARS[var])
    return expr


def dashboard_queries() -> Iterator[tuple[str, str]]:
    for panel in json.loads(DASHBOARD_FILE.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']} [{target['refId']}]", grafana_expand(target["expr"])


def expired_by_pod(prom: Prometheus) -> dict[str, float]:
    """Each scraped pod's count of records deleted by retention, as Prometheus last scraped it."""
    return {r["metric"]["pod"]: float(r["value"][1]) for r in prom.query("r3_records_expired_total")}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    work = tmp_path_factory.mktemp("prom-live")
    file_copy = work / "rules-file.yaml"
    chart_copy = work / "rules-chart.yaml"
    file_copy.write_text(yaml.safe_dump(shorten_for(RULES, FOR)))
    (rule,) = [o for o in render({"prometheusRule": {"enabled": True}}) if o["kind"] == "PrometheusRule"]
    chart_copy.write_text(yaml.safe_dump(shorten_for(rule["spec"], FOR)))
    files = [file_copy.name, chart_copy.name]
    obs = Observed()
    stop_trainers = threading.Event()
    binary = prometheus_binary()
    assert binary is not None, "no Prometheus server binary (PROMETHEUS, PATH)"
    with contextlib.ExitStack() as stack:
        prom = stack.enter_context(Prometheus(binary, work, [file_copy, chart_copy]))
        demo = {}
        # The demo engines rewrite their engine files every second; on a starved 2-core machine one once went
        # 10 s (the default `R3_ENGINE_STALE_S`) without a turn, and the baseline saw a stale engine. Staleness
        # is proved on pod r3-2 below; the demo pods allow a minute.
        for pod in ("r3-0", "r3-1"):
            addr, proc = stack.enter_context(
                sidecar(
                    "demo", work / f"spool-{pod}", work / f"{pod}.log", R3_TTL_S=str(DEMO_TTL_S), R3_ENGINE_STALE_S="60"
                )
            )
            demo[pod] = (addr, proc)
        prom.set_targets({pod: addr for pod, (addr, _) in demo.items()})
        trainers = [Trainer(f"http://{addr}", stop_trainers) for addr, _ in demo.values()]
        stack.callback(lambda: [t.join(70) for t in trainers])
        stack.callback(stop_trainers.set)
        for t in trainers:
            t.start()
        # Warm-up: both pods scraped with their engines' series, and the rules evaluated since (an `absent()`
        # rule may fire before the first scrape lands on a loaded machine), before the baseline starts.
        wait_until(
            lambda: (
                len(prom.query("r3_engine_stale")) >= 2 and len(prom.query("up == 1")) >= 2 and not prom.active_alerts()
            ),
            90,
            lambda: f"the demo pods settled in Prometheus (active: {prom.active_alerts()})",
            interval=0.5,
        )
        obs.rule_files = sorted({Path(g["file"]).name for g in prom.rule_groups()})

        # ---- healthy baseline ------------------------------------------------------------------
        expired_before = expired_by_pod(prom)
        t0 = time.monotonic()
        while time.monotonic() - t0 < BASELINE_S:
            obs.baseline_active += prom.active_alerts()
            time.sleep(1.0)  # not a wait: one sample a second over the baseline window, in which nothing may fire
        obs.baseline_s = time.monotonic() - t0
        obs.baseline_expired = {
            pod: n - expired_before.get(pod, 0.0) for pod, n in expired_by_pod(prom).items() if pod in demo
        }

        # ---- provoke ---------------------------------------------------------------------------
        watch = Watcher(prom, obs)
        spool = Spool(work / "spool-r3-2")
        addr2, proc2 = stack.enter_context(
            sidecar("serve", spool.root, work / "r3-2.log", R3_SPOOL_MAX_BYTES=str(1 << 20), R3_ENGINE_STALE_S="5")
        )
        exporter = stack.enter_context(
            CounterExporter('r3_engine_undelivered_total{{engine="r3-3/dp0",reason="spool_full"}} {value}\n')
        )
        prom.set_targets({**{pod: addr for pod, (addr, _) in demo.items()}, "r3-2": addr2, "r3-3": exporter.address})
        watch.provoke("R3EngineTelemetryAbsent", "R3RowsUndelivered")
        watch.until_firing(["R3EngineTelemetryAbsent", "R3RowsUndelivered"], files)

        fallback = iter(range(1 << 30))

        def write_engines() -> None:
            failed = {"hook": "on_forward_end", "target": "ModelRunner.forward", "error": "KeyError: 3", "since": 1.0}
            spool.write_engine({**engine_file("r3-2/dp0", time.time(), next(fallback)), "degraded": [failed]})
            spool.write_engine({**engine_file("r3-2/dp1", time.time() - 3600, 0), "dp_rank": 1})

        write_engines()
        write_record(spool, "dir", random_rows(8))
        spool.bin_path("dir").unlink()
        spool.bin_path("dir").mkdir()
        write_record(spool, "fill", np.zeros((30_000, 4, 8), dtype=np.uint8))  # 960 KB of the 1 MiB spool
        base2 = f"http://{addr2}"

        def bad_fetches() -> None:
            assert httpx.get(f"{base2}/routed_experts/dir", timeout=30).status_code == 500
            assert httpx.get(f"{base2}/routed_experts/nobody", timeout=30).status_code == 404

        provoked = [
            "R3BudgetNotMet",
            "R3BufferHeadroomLow",
            "R3InlineFallbacksRising",
            "R3EngineDegraded",
            "R3SuspectRecords",
            "R3EngineTelemetryStale",
            "R3FetchServerErrors",
            "R3FetchRecordsMissing",
            "R3SpoolNearlyFull",
        ]
        watch.provoke(*provoked)
        # The engine files stay fresh until the end: dp0 must never go stale, however long the phases below take
        # under load (seen: dp0 stale 5 s after the refreshes stopped, firing beside dp1).
        stack.enter_context(repeating(write_engines, 0.5, obs.engine_writes))
        with repeating(bad_fetches, 0.1, obs.bad_fetches):
            watch.until_firing(provoked, files)
            for where, expr in dashboard_queries():
                obs.panel_results[where] = len(prom.query(expr))
            # Once the engine files are there, the absent-telemetry alert resolves.
            wait_until(
                lambda: not any(a[1] == "R3EngineTelemetryAbsent" for a in watch.poll()),
                30,
                "R3EngineTelemetryAbsent resolved",
                interval=0.25,
            )

        # ---- pods go away ------------------------------------------------------------------------
        watch.provoke("R3SidecarDown")
        stop_process(demo["r3-1"][1])
        watch.until_firing(["R3SidecarDown"], files)
        # Every sidecar leaves service discovery (pods deleted, or the ServiceMonitor stops matching them).
        stop_trainers.set()
        watch.provoke("R3SidecarMetricsAbsent")
        prom.set_targets({"r3-3": exporter.address})
        # Discovery updates reach the scrape manager at most every 5 s: stop the processes once their targets
        # are gone, or their failing scrapes would (rightly) page as R3SidecarDown first.
        wait_until(lambda: not prom.query('up{pod=~"r3-[0-2]"}'), 30, "the sidecars' targets dropped", interval=0.25)
        for _, proc in (*demo.values(), (addr2, proc2)):
            stop_process(proc)
        watch.until_firing(["R3SidecarMetricsAbsent"], files)
        for t in trainers:
            for code, n in t.codes.items():
                obs.fetch_codes[code] = obs.fetch_codes.get(code, 0) + n
    return obs


def test_both_rule_copies_are_loaded(scenario: Observed) -> None:
    assert scenario.rule_files == ["rules-chart.yaml", "rules-file.yaml"]


def test_healthy_baseline_fires_nothing(scenario: Observed) -> None:
    assert scenario.baseline_s >= BASELINE_S
    assert scenario.baseline_active == [], scenario.baseline_active
    # retention ran on both demo pods inside the window: the baseline watched the spool's steady state
    assert sorted(scenario.baseline_expired) == ["r3-0", "r3-1"], scenario.baseline_expired
    assert all(n > 0 for n in scenario.baseline_expired.values()), scenario.baseline_expired
    served = sum(scenario.fetch_codes.values())
    assert served > 100 and scenario.fetch_codes.get("200", 0) > 0.8 * served, scenario.fetch_codes


@pytest.mark.parametrize("alert", ALERTS)
def test_alert_goes_pending_then_firing(scenario: Observed, alert: str) -> None:
    for file in ("rules-file.yaml", "rules-chart.yaml"):
        key = (file, alert)
        assert key in scenario.firing_s, f"{alert} never fired from {file}; saw {sorted(scenario.firing_s)}"
        assert scenario.pending_s[key] <= scenario.firing_s[key]


def test_alerts_fire_only_where_provoked(scenario: Observed) -> None:
    labels = scenario.firing_labels
    f = "rules-file.yaml"
    assert {(x["pod"], x["buffer"]) for x in labels[(f, "R3BufferHeadroomLow")]} == {("r3-2", "host_cache")}
    assert {x["engine"] for x in labels[(f, "R3EngineTelemetryStale")]} == {"r3-2/dp1"}
    assert {x["pod"] for x in labels[(f, "R3FetchServerErrors")]} == {"r3-2"}
    assert {x["pod"] for x in labels[(f, "R3SidecarDown")]} == {"r3-1"}
    assert {x["pod"] for x in labels[(f, "R3EngineTelemetryAbsent")]} == {"r3-2"}
    assert {x["reason"] for x in labels[(f, "R3RowsUndelivered")]} == {"spool_full"}
    assert not scenario.unexpected, scenario.unexpected


def test_provoking_loops_did_what_they_claim(scenario: Observed) -> None:
    """The record whose `.bin` is a directory answered 500 and the unknown rid 404 on every try, and the engine
    files were written every time: R3FetchServerErrors and R3FetchRecordsMissing fired for those answers."""
    for name, seen in (("bad fetches", scenario.bad_fetches), ("engine-file writes", scenario.engine_writes)):
        assert seen.runs > 0, f"{name} never ran"
        assert not seen.failures, f"{name}: {len(seen.failures)} of {seen.runs} failed: {seen.failures[:3]}"


def test_every_dashboard_query_returns_data(scenario: Observed) -> None:
    assert len(scenario.panel_results) >= 20
    empty = [where for where, n in scenario.panel_results.items() if n == 0]
    assert not empty, f"queries with no data from a live Prometheus: {empty}"


def test_measured_times_are_reported(scenario: Observed, record_property: Callable[[str, object], None]) -> None:
    """The times RELIABILITY.md quotes: provocation → pending and → firing, per alert (rule-file copy)."""
    rows = {
        a: (scenario.pending_s.get(("rules-file.yaml", a)), scenario.firing_s.get(("rules-file.yaml", a)))
        for a in ALERTS
    }
    record_property("alert_times_s", json.dumps(rows))
    print(f"\nbaseline {scenario.baseline_s:.1f} s, trainer answers {scenario.fetch_codes}")
    print("alert: provocation → pending, → firing (s), for=" + FOR)
    for alert, (p, fi) in rows.items():
        print(f"  {alert}: {p and round(p, 1)} {fi and round(fi, 1)}")
    assert all(fi is not None for _p, fi in rows.values())
    assert re.fullmatch(r"\d+s", FOR)
