"""The targets table and the measured decompositions at the top of BENCHMARKS.md, computed from one run's
results (`document.py` writes them): each target with its measured value, the gap to it, met or missed.
"""

from __future__ import annotations

from benchmarks.report.tables import ms, status


def targets(results: dict) -> list[list[str]]:
    """Each target: its measured value, the gap to it, met or missed."""
    return [
        *_delivery_targets(results.get("delivery", [])),
        *_fetch_targets(results.get("concurrency", []), results.get("limits")),
        *_engine_targets(results.get("engine", {}).get("finish", [])),
        *_memory_targets(results.get("memory", [])),
    ]


def _delivery_targets(delivery: list[dict]) -> list[list[str]]:
    """Bytes on the wire against inline, and the trainer's end-to-end time at long requests."""
    rows: list[list[str]] = []
    small = [d for d in delivery if d["model"] in ("Qwen3-30B-A3B", "DeepSeek-V3")]
    if small:
        worst = max(small, key=lambda d: d["bytes_ratio"])
        rows.append(
            [
                "bytes on the wire ≤ 1/5 of inline (≤256 experts)",
                f"worst {worst['bytes_ratio']:.3f} ({worst['model']}, {worst['tokens']})",
                f"{0.2 - worst['bytes_ratio']:+.3f} below the bound",
                status(worst["bytes_ratio"] <= 0.2),
            ]
        )
    long = [d for d in delivery if d["tokens"] >= 8192]
    if long:
        worst = min(long, key=lambda d: d["speedup"])
        rows.append(
            [
                "trainer end-to-end ≥ 10× faster than inline at 8k and 32k",
                f"worst {worst['speedup']:.1f}× ({worst['model']}, {worst['tokens']})",
                f"{worst['speedup'] / 10:.2f}× the target",
                status(worst["speedup"] >= 10),
            ]
        )
    return rows


def _fetch_targets(conc: list[dict], lim: dict | None) -> list[list[str]]:
    """A single stream against raw loopback TCP, and the tail of the most concurrent fetchers."""
    rows: list[list[str]] = []
    single = next((c for c in conc if c["mode"] == "get" and c["concurrency"] == 1), None)
    if single and lim:
        frac = single["gbps"] / lim["loopback"]["gbps"]
        trips = lim.get("loopback_round_trips")
        per_trip = f"; {single['gbps'] / trips['gbps']:.0%} of loopback one record per round trip" if trips else ""
        batched = next((c for c in conc if c["mode"] == "get_many" and c["concurrency"] == 1), None)
        many = f"; `get_many` {batched['gbps'] / lim['loopback']['gbps']:.0%} of streaming" if batched else ""
        rows.append(
            [
                "single-stream fetch ≥ 50% of raw loopback TCP",
                f"`get` {single['gbps']:.2f} / {lim['loopback']['gbps']:.2f} GB/s streaming = {frac:.0%}"
                + per_trip
                + many,
                f"{frac - 0.5:+.0%} points",
                status(frac >= 0.5),
            ]
        )
    top = [c for c in conc if c["concurrency"] == max(c2["concurrency"] for c2 in conc) and c["mode"] != "lean_get"]
    for c in top:
        ok = c["errors"] == 0 and c["cold"]["errors"] == 0 and c["p99_over_p50"] <= 3
        rows.append(
            [
                f"{c['concurrency']} concurrent fetchers ({c['mode']}): no errors, p99 ≤ 3× p50",
                f"{c['errors'] + c['cold']['errors']} errors; p99/p50 = {c['p99_over_p50']:.2f} warm, "
                f"{c['cold']['p99_over_p50']:.2f} cold",
                f"{3 - c['p99_over_p50']:+.2f} below 3×",
                status(ok),
            ]
        )
    return rows


def _engine_targets(engine: list[dict]) -> list[list[str]]:
    """The scheduler thread's cost per finished request, the worst case against upstream's."""
    if not engine:
        return []
    ratios = [(e["ours_total"]["p50"] / e["upstream_total"]["p50"], e) for e in engine]
    worst_ratio, worst = max(ratios, key=lambda x: x[0])
    return [
        [
            "scheduler-thread cost per finished request ≤ upstream's",
            f"worst ours/upstream = {worst_ratio:.2f} ({worst['model']}, {worst['tokens']})",
            f"{1 - worst_ratio:+.0%} of upstream's",
            status(worst_ratio <= 1),
        ]
    ]


def _memory_targets(memory: list[dict]) -> list[list[str]]:
    """The sidecar's private memory growth against the spool bytes it serves, per spool size."""
    return [
        [
            f"sidecar RSS overhead ≤ 10% of spool bytes ({m['spool_bytes'] / 1e9:.1f} GB)",
            f"private (anon) growth {m['anon_overhead_ratio']:.2%}; total RSS = {m['rss_over_spool']:.2f}× spool",
            f"{0.10 - m['anon_overhead_ratio']:+.2%} points",
            status(m["anon_overhead_ratio"] <= 0.10),
        ]
        for m in memory
    ]


def analysis(results: dict) -> list[str]:
    """Measured decompositions behind the targets, computed from this run's numbers (see BENCHMARKS.md's findings)."""
    out = []
    bd, lim = results.get("breakdown", {}), results.get("limits")
    stacks = bd.get("client_stacks", {}).get("stacks")
    if stacks:
        ours, lean, raw = (
            stacks[k]["p50"] for k in ("RoutedExpertsClient.get", "http.client readinto", "raw socket recv_into")
        )
        out.append(
            f"Single record, single stream: the project's client takes {ms(ours)} ms, the same GET read by "
            f"`http.client` into a sized buffer {ms(lean)} ms, a raw socket with no HTTP parsing {ms(raw)} ms: "
            f"the client's HTTP stack is {1 - lean / ours:.0%} of the fetch time."
        )
    conc = results.get("concurrency", [])
    lean1 = next((c for c in conc if c["mode"] == "lean_get" and c["concurrency"] == 1), None)
    if lean1 and lim:
        out.append(
            f"Batch fetch through the reference reader: {lean1['gbps']:.2f} GB/s single stream = "
            f"{lean1['gbps'] / lim['loopback']['gbps']:.0%} of raw loopback (the sidecar's own share of the gap)."
        )
    long = [d for d in results.get("delivery", []) if d["tokens"] >= 8192]
    if long:
        worst = min(long, key=lambda d: d["speedup"])
        out.append(
            f"Slowest delivery case ({worst['model']}, {worst['tokens']} tokens): ours "
            f"{ms(worst['ours_s']['p50'])} ms = spool write {ms(worst['ours_write_s']['p50'])} ms + fetch; "
            "with the reference reader "
            f"{ms(worst['ours_lean_s']['p50'])} ms, {worst['speedup_lean']:.1f}× inline."
        )
    for c in conc:
        if c["concurrency"] == max(x["concurrency"] for x in conc) and c["mode"] != "lean_get":
            out.append(
                f"{c['concurrency']} fetchers, `{c['mode']}`: p99/p50 {c['p99_over_p50']:.2f} with warm connections, "
                f"{c['cold']['p99_over_p50']:.2f} when all {c['concurrency']} connections open inside the clock."
            )
    comp = bd.get("compaction", [])
    if comp:
        big = max(comp, key=lambda c: (c["model"] != "Qwen3-30B-A3B", c["tokens"]))
        out.append(
            f"Finish-time compaction ({big['model']}, {big['tokens']} tokens, thread CPU): upstream's gather "
            f"{big['upstream_gather_ms']:.2f} ms; the plugin's gather + `to_spool_rows` "
            f"{big['plugin_gather_compact_ms']:.2f} ms; one fused numpy gather of the routed layers + cast "
            f"{big['fused_numpy_ms']:.2f} ms."
        )
    return out
