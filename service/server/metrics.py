"""Prometheus metrics of Contract 3, one `CollectorRegistry` per app.

Request counters are updated by the API as it serves. Everything that is a fact about the spool or the
engines (records by state, bytes, engine budgets and occupancy) is read at scrape time by a custom
collector, so there is no background poller and no second copy of the truth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.server.store import Store
from service.spool.engine_report import EngineReport, EngineReportError, WriterCounters

log = logging.getLogger("r3.metrics")
T = TypeVar("T")

FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0, 600.0)
RECORD_STATES = ("open", "ok", "aborted", "error", "suspect")
ACK_KINDS = ("delete", "rids", "weight_version")


# `code` values of `r3_served_total` that are not HTTP statuses: the answer started (200 headers sent) and
# did not finish. `abort`: the sidecar failed mid-body and cut the connection (a server fault, alerted on
# with the 5xx). `499` (nginx's convention): the client went away or stopped reading first.
CODE_ABORT = "abort"
CODE_CLIENT_GONE = "499"
# Label values created at start (at 0), so dashboards and ratios find the series before the first event.
FORMATS = ("npy", "raw", "json", "sglang_b64", "frames", "batch")
GONE_REASONS = ("expired", "record_aborted", "record_error", "truncated_bin", "missing_bin")


class Metrics:
    """The counters the API updates, plus the scrape-time collector over the store."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.served = Counter(
            "r3_served",
            "Record answers, by format and outcome: one per rid (a batch counts each rid, a stream once). `code` is "
            "the HTTP status (a frame's own status in a batch or stream), `abort` when the sidecar failed after "
            "the headers and cut the connection, `499` when the client left first.",
            ["format", "code"],
            registry=self.registry,
        )
        self.served_aborted = Counter(
            "r3_served_aborted",
            "200 answers that carried an aborted request's partial rows (X-R3-Status: aborted); also in r3_served.",
            ["format"],
            registry=self.registry,
        )
        self.served_gone = Counter(
            "r3_served_gone",
            "410 answers by why the record is gone: `expired` (fetched after R3_TTL_S; the trainer came too late), "
            "`record_aborted`/`record_error` (the request ended so), `truncated_bin`/`missing_bin` (corrupt).",
            ["reason"],
            registry=self.registry,
        )
        self.served_bytes = Counter("r3_served_bytes", "Body bytes of record responses.", registry=self.registry)
        self.fetch_seconds = Histogram(
            "r3_fetch_seconds",
            "Time to serve one record request, waits excluded (see r3_fetch_wait_seconds).",
            buckets=FETCH_BUCKETS,
            registry=self.registry,
        )
        self.wait_seconds = Histogram(
            "r3_fetch_wait_seconds",
            "Time one request spent waiting for its record (`wait=` long polls, streams waiting for rows).",
            buckets=FETCH_BUCKETS,
            registry=self.registry,
        )
        self.local_reads = Counter(
            "r3_local_reads",
            "Records clients on this node read straight from the spool (not through this sidecar), as they "
            "reported them (batched, at most a second late). Not in r3_served_total.",
            registry=self.registry,
        )
        self.local_read_bytes = Counter(
            "r3_local_read_bytes", "Bytes of rows clients read straight from the spool.", registry=self.registry
        )
        for fmt in FORMATS:
            self.served_aborted.labels(format=fmt)
        for reason in GONE_REASONS:
            self.served_gone.labels(reason=reason)
        self.registry.register(SpoolCollector(store))

    def fetch(self, fmt: str) -> Fetch:
        """Start the accounting of one request."""
        return Fetch(self, fmt)


class Fetch:
    """One request's accounting: its outcomes (one per rid) and its time, split into waiting and serving.

    Why split: a long poll that waits 60 s for a record that is not written yet says nothing about how fast
    the sidecar serves; mixed into one histogram it hides every real slowdown behind the waits.
    """

    def __init__(self, metrics: Metrics, fmt: str) -> None:
        self.metrics, self.fmt = metrics, fmt
        self.t0 = time.perf_counter()
        self.waited = 0.0
        self.waits = 0
        self.counted = 0

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (a store wait), booking its time as waiting."""
        t = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.waited += time.perf_counter() - t
            self.waits += 1

    def count(self, code: int | str, record_status: str = "ok", error: str | None = None) -> None:
        """Count one rid's outcome; a 200 of an aborted record also as served-aborted, a 410 by its `error`."""
        self.metrics.served.labels(format=self.fmt, code=str(code)).inc()
        if code == 200 and record_status == "aborted":
            self.metrics.served_aborted.labels(format=self.fmt).inc()
        elif code == 410:
            self.metrics.served_gone.labels(reason=error or "gone").inc()
        self.counted += 1

    def finish(self, nbytes: int = 0) -> None:
        """Observe the request's times and body bytes (once, when its answer ends)."""
        m = self.metrics
        if nbytes:
            m.served_bytes.inc(nbytes)
        m.fetch_seconds.observe(max(0.0, time.perf_counter() - self.t0 - self.waited))
        if self.waits:
            m.wait_seconds.observe(self.waited)


_ENGINE_GAUGES = (
    ("r3_buffer_capacity", "Capacity of an engine buffer, in its unit.", ["engine", "buffer"]),
    ("r3_buffer_peak", "Peak use of an engine buffer over the last window.", ["engine", "buffer"]),
    ("r3_buffer_headroom_ratio", "1 - peak/capacity over the last window.", ["engine", "buffer"]),
    ("r3_budget_capacity", "Budgeted capacity of a buffer at launch.", ["engine", "buffer"]),
    ("r3_budget_demand", "Worst-case demand on a buffer at launch.", ["engine", "buffer"]),
    ("r3_budget_ok", "1 when the buffer's capacity covers its worst-case demand.", ["engine", "buffer"]),
    ("r3_host_cache_used_tokens", "Tokens held in the host routed-experts cache.", ["engine"]),
    ("r3_host_cache_capacity_tokens", "Capacity of the host routed-experts cache in tokens.", ["engine"]),
    ("r3_engine_queued_bytes", "Bytes queued in the engine's spool writer.", ["engine"]),
    ("r3_engine_stale", "1 when the engine file was not updated within engine_stale_s.", ["engine"]),
    (
        "r3_engine_build_info",
        "1 per engine: the engine build found, the layout the plugin applied, whether a test proved that build "
        "(proven), and an unproven build's self-check against the engine's own rows (check: pending, agreed; "
        "none where proven).",
        ["engine", "found", "layout", "proven", "check"],
    ),
)
_ENGINE_COUNTERS = (
    ("r3_engine_fallback_inline", "Requests that kept SGLang's inline payload (spool refused).", ["engine"]),
    (
        "r3_engine_undelivered",
        "Requests whose rows the engine could not deliver to the spool, by reason (spool_full, queue_full, "
        "spool_not_writable, mirror_mismatch, write_error); those that asked for routed experts kept SGLang's "
        "inline payload (r3_engine_fallback_inline), the rest are lost.",
        ["engine", "reason"],
    ),
    ("r3_engine_records_written", "Records the engine's writer thread finalized in the spool.", ["engine"]),
    (
        "r3_engine_reservations_refused",
        "Spool reservations the engine refused, by reason (spool_full, queue_full); live-row appends included, "
        "so one request may count several times (r3_engine_undelivered_total counts requests).",
        ["engine", "reason"],
    ),
    ("r3_engine_write_errors", "Spool writes that failed on the engine's writer thread.", ["engine"]),
    (
        "r3_engine_suspect_records",
        "Records the engine's writer thread marked suspect: rows no true route has (a repeated or out-of-range "
        "expert id, a dense slot not zero), kept and served only on request (suspect=allow).",
        ["engine"],
    ),
    (
        "r3_engine_hook_seconds",
        "Seconds of the plugin's own work on the scheduler thread, by hook (forward_extent, forward_end, "
        "batch_result, live_step, collect, finalize) and forward kind (extend, decode, verify, idle, "
        "other); the SGLang code each hook wraps is not counted. Absent when R3_HOOK_TIMERS=0.",
        ["engine", "hook", "kind"],
    ),
    ("r3_engine_hook_calls", "Calls of each timed hook (see r3_engine_hook_seconds).", ["engine", "hook", "kind"]),
    (
        "r3_engine_degraded_hooks",
        "Hooks whose plugin code failed in an engine process (the engine file's `degraded`): that process runs "
        "SGLang's own code at every hook since, rows inline, nothing new in the spool. 0 for a healthy engine.",
        ["engine", "hook"],
    ),
)


def engine_families(engines: list[dict[str, Any]], stale_after_s: float, now: float) -> list[Any]:
    """Contract 3's per-engine gauges from engine files (pure: no I/O); a malformed file leaves out its engine."""
    g = {name: GaugeMetricFamily(name, doc, labels=labels) for name, doc, labels in _ENGINE_GAUGES}
    c = {name: CounterMetricFamily(name, doc, labels=labels) for name, doc, labels in _ENGINE_COUNTERS}
    for obj in engines:
        try:
            report = EngineReport.from_dict(obj)
        except EngineReportError as exc:
            log.warning("engine file of %r is malformed (%s); its gauges are left out", obj.get("engine"), exc)
            continue
        engine = report.engine
        _add_buffers(g, report)
        g["r3_host_cache_used_tokens"].add_metric([engine], float(report.used_tokens))
        g["r3_host_cache_capacity_tokens"].add_metric([engine], float(report.capacity_tokens))
        g["r3_engine_queued_bytes"].add_metric([engine], float(report.writer.queued_bytes))
        g["r3_engine_stale"].add_metric([engine], 1.0 if now - report.updated > stale_after_s else 0.0)
        if (build := report.build) is not None:
            check = "none" if build.check is None else str(build.check["state"])
            labels = [engine, build.found, build.layout, str(build.proven).lower(), check]
            g["r3_engine_build_info"].add_metric(labels, 1.0)
        _add_writer(c, engine, report.writer)
        for hook, kinds in sorted((report.hooks or {}).items()):
            for kind, t in sorted(kinds.items()):
                c["r3_engine_hook_seconds"].add_metric([engine, hook, kind], float(t.seconds))
                c["r3_engine_hook_calls"].add_metric([engine, hook, kind], float(t.calls))
        _add_degraded(c["r3_engine_degraded_hooks"], engine, report)
    return [*g.values(), *c.values()]


def _add_buffers(g: dict[str, GaugeMetricFamily], report: EngineReport) -> None:
    """Each engine buffer's use over the last window (occupancy) and its budget at launch."""
    engine = report.engine
    for occ in report.occupancy:
        cap, peak = float(occ.capacity), float(occ.peak)
        g["r3_buffer_capacity"].add_metric([engine, occ.buffer], cap)
        g["r3_buffer_peak"].add_metric([engine, occ.buffer], peak)
        g["r3_buffer_headroom_ratio"].add_metric([engine, occ.buffer], 1.0 - peak / cap if cap > 0 else 0.0)
    for bud in report.budget:
        g["r3_budget_capacity"].add_metric([engine, bud.buffer], float(bud.capacity))
        g["r3_budget_demand"].add_metric([engine, bud.buffer], float(bud.demand))
        g["r3_budget_ok"].add_metric([engine, bud.buffer], 1.0 if bud.ok else 0.0)


def _add_writer(c: dict[str, CounterMetricFamily], engine: str, w: WriterCounters) -> None:
    """The engine's spool writer: what it wrote, refused and could not deliver (a counter absent from an older
    engine's file is left out, not reported as 0)."""
    c["r3_engine_fallback_inline"].add_metric([engine], float(w.fallback_inline))
    c["r3_engine_records_written"].add_metric([engine], float(w.records_written))
    c["r3_engine_reservations_refused"].add_metric([engine, "spool_full"], float(w.spool_full))
    if w.queue_full is not None:
        c["r3_engine_reservations_refused"].add_metric([engine, "queue_full"], float(w.queue_full))
    if w.write_errors is not None:
        c["r3_engine_write_errors"].add_metric([engine], float(w.write_errors))
    if w.suspect_records is not None:
        c["r3_engine_suspect_records"].add_metric([engine], float(w.suspect_records))
    not_delivered = [(reason, float(count)) for reason, count in sorted((w.undelivered or {}).items())]
    for reason, count in not_delivered:
        c["r3_engine_undelivered"].add_metric([engine, reason], count)
    if any(count for _, count in not_delivered):
        _log_undelivered(engine, not_delivered)


def _add_degraded(family: CounterMetricFamily, engine: str, report: EngineReport) -> None:
    """One series per failed hook (a hook fails once: the process never runs it again)."""
    for fault in report.degraded or ():
        family.add_metric([engine, fault.hook], 1.0)


_undelivered_seen: dict[str, tuple[tuple[str, float], ...]] = {}


def _log_undelivered(engine: str, counts: list[tuple[str, float]]) -> None:
    """One warning in the sidecar's log each time an engine's undelivered counts grow (seen at scrape time)."""
    key = tuple(counts)
    if _undelivered_seen.get(engine) != key:
        _undelivered_seen[engine] = key
        text = ", ".join(f"{reason}={int(count)}" for reason, count in counts if count)
        log.warning("engine %r could not deliver some requests' rows to the spool: %s", engine, text)


class SpoolCollector(Collector):
    """Reads the store and the engine files at scrape time."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        store = self.store
        records = GaugeMetricFamily("r3_records", "Records in the spool, by state.", labels=["state"])
        counts = store.state_counts()
        for state in (*RECORD_STATES, *sorted(set(counts) - set(RECORD_STATES))):
            records.add_metric([state], counts.get(state, 0))
        yield records
        yield GaugeMetricFamily("r3_spool_bytes", "Bytes held by record files.", value=store.usage_bytes())
        yield GaugeMetricFamily(
            "r3_spool_capacity_bytes",
            "Spool capacity (R3_SPOOL_MAX_BYTES or the file system size).",
            value=store.capacity_bytes(),
        )
        yield CounterMetricFamily(
            "r3_records_expired", "Records deleted by retention (TTL).", value=store.expired_total
        )
        acked = CounterMetricFamily(
            "r3_acked",
            "Records freed by a trainer's acknowledgement, by how: `delete` (DELETE one rid), `rids` and "
            "`weight_version` (POST /routed_experts/ack by a list of rids, or everything older than a version).",
            labels=["how"],
        )
        for how in ACK_KINDS:
            acked.add_metric([how], store.acked.get(how, 0))
        yield acked
        engines = store.engines()
        skipped = CounterMetricFamily(
            "r3_spool_skipped", "Malformed or foreign spool files skipped, by reason.", labels=["reason"]
        )
        for reason, count in sorted(store.skipped.items()):
            skipped.add_metric([reason], count)
        yield skipped
        yield from engine_families(engines, store.settings.engine_stale_s, time.time())
