"""The tables of BENCHMARKS.md's sections 1-6, one function a section, from one run's results
(`benchmarks/report/document.py` puts them under their headings), and how every figure in them is written.
"""

from __future__ import annotations

import math


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


# ---- sections ----------------------------------------------------------------------------------------


def delivery_section(rows: list[dict]) -> str:
    body = [
        [
            d["model"],
            f"{d['tokens']}",
            mb(d["inline_bytes"]),
            mb(d["ours_bytes"]),
            f"{d['bytes_ratio']:.3f}",
            ms(d["inline_s"]["p50"]),
            ms(d["inline_server_s"]["p50"]),
            ms(d["ours_s"]["p50"]),
            ms(d["ours_write_s"]["p50"]),
            f"{d['speedup']:.1f}×",
            ms(d["ours_lean_s"]["p50"]),
            f"{d['speedup_lean']:.1f}×",
            str(d["inline_s"]["n"]),
        ]
        for d in rows
    ]
    header = [
        "model",
        "tokens",
        "inline MB",
        "ours MB",
        "bytes ratio",
        "inline e2e ms",
        "of which server encode+JSON ms",
        "ours e2e ms",
        "of which spool write ms",
        "speedup",
        "ours e2e, reference reader ms",
        "speedup, reference reader",
        "reps",
    ]
    return table(header, body)


def concurrency_section(rows: list[dict], lim: dict | None) -> str:
    loop = lim["loopback"]["gbps"] if lim else math.nan
    body = [
        [
            c["mode"],
            str(c["concurrency"]),
            str(c["rids_per_request"]),
            f"{c['gbps']:.3f}",
            f"{c['gbps'] / loop:.0%}" if lim else "n/a",
            ms(c["latency"]["p50"]),
            ms(c["latency"]["p99"]),
            f"{c['p99_over_p50']:.2f}",
            str(c["latency"]["n"]),
            str(c["errors"]),
            f"{c['cold']['gbps']:.3f}",
            f"{c['cold']['p99_over_p50']:.2f}",
            str(c["cold"]["errors"]),
        ]
        for c in rows
    ]
    header = ["client call", "fetchers", "rids/request", "GB/s", "of loopback", "p50 ms", "p99 ms", "p99/p50"]
    return table([*header, "requests", "errors", "cold GB/s", "cold p99/p50", "cold errors"], body)


def limits_section(lim: dict) -> str:
    body = [
        ["numpy copy, one record", mb(lim["memcpy_record"]["bytes"]), f"{lim['memcpy_record']['gbps']:.2f}"],
        ["numpy copy, whole batch", mb(lim["memcpy_batch"]["bytes"]), f"{lim['memcpy_batch']['gbps']:.2f}"],
        ["loopback TCP, one connection, streaming", mb(lim["loopback"]["bytes"]), f"{lim['loopback']['gbps']:.2f}"],
    ]
    trips = lim.get("loopback_round_trips")
    if trips:
        body.append(
            ["loopback TCP, one connection, one record per round trip", mb(trips["bytes"]), f"{trips['gbps']:.2f}"]
        )
    return table(["path", "MB moved", "GB/s (median)"], body)


def engine_section(engine: dict) -> str:
    finish = [
        [
            e["model"],
            str(e["tokens"]),
            ms(e["upstream_gather"]["p50"]),
            ms(e["upstream_ipc_encode"]["p50"]),
            ms(e["upstream_total"]["p50"]),
            ms(e["upstream_total_cpu"]["p50"]),
            ms(e["ours_total"]["p50"]),
            ms(e["ours_total_cpu"]["p50"]),
            f"{e['ours_total']['p50'] / e['upstream_total']['p50']:.2f}",
            f"{e['ours_total_cpu']['p50'] / e['upstream_total_cpu']['p50']:.2f}",
        ]
        for e in engine["finish"]
    ]
    header = [
        "model",
        "tokens",
        "upstream get_topk ms",
        "upstream msgpack of the tensor ms",
        "upstream total ms",
        "upstream total CPU ms",
        "ours Collector ms",
        "ours CPU ms",
        "ours/upstream (wall)",
        "ours/upstream (CPU)",
    ]
    live = [
        [
            e["model"],
            str(e["batch"]),
            f"{e['per_step']['p50'] * 1e6:.0f}",
            f"{e['per_step']['p99'] * 1e6:.0f}",
            f"{e['per_step_cpu']['p50'] * 1e6:.0f}",
            f"{e['finish_marker']['p50'] * 1e6:.0f}",
        ]
        for e in engine["live"]
    ]
    live_header = ["model", "running requests", "per step p50 µs", "per step p99 µs", "per step CPU µs", "at finish µs"]
    return (
        table(header, finish)
        + "\n\nWith live rows (one row per running request per decode step):\n\n"
        + table(live_header, live)
    )


def breakdown_section(bd: dict) -> str:
    parts = []
    cs = bd.get("client_stacks")
    if cs:
        body = [
            [name, ms(v["p50"]), f"{cs['bytes'] / v['p50'] / 1e9:.3f}", str(v["n"])] for name, v in cs["stacks"].items()
        ]
        parts.append(
            f"One record ({mb(cs['bytes'])} MB) from the same sidecar, single stream:\n\n"
            + table(["client stack", "p50 ms", "GB/s", "reps"], body)
        )
    comp = bd.get("compaction")
    if comp:
        body = [
            [
                c["model"],
                str(c["tokens"]),
                f"{c['upstream_gather_ms']:.3f}",
                f"{c['plugin_gather_compact_ms']:.3f}",
                f"{c['fused_numpy_ms']:.3f}",
            ]
            for c in comp
        ]
        header = [
            "model",
            "tokens",
            "upstream gather (all layers, int32) CPU ms",
            "plugin: gather + `to_spool_rows` CPU ms",
            "one fused numpy gather of the routed layers + cast CPU ms",
        ]
        parts.append(
            "Finish-time compaction on the scheduler thread (thread CPU time, median):\n\n" + table(header, body)
        )
    live = bd.get("live_compaction")
    if live:
        body = [[c["model"], str(c["batch"]), f"{c['per_request_us']:.0f}", f"{c['per_step_us']:.0f}"] for c in live]
        header = ["model", "running requests", "per request (`to_spool_rows` each) µs", "once per step + views µs"]
        parts.append("Live rows, compaction of one decode step (thread CPU time, median):\n\n" + table(header, body))
    return "\n\n".join(parts)


def memory_section(rows: list[dict]) -> str:
    body = [
        [
            f"{m['spool_bytes'] / 1e9:.2f}" + ("" if m["fits"] else f" (wanted {m['wanted_bytes'] / 1e9:.0f})"),
            str(m["records"]),
            mb(m["baseline"]["VmRSS"]),
            mb(m["indexed"]["VmRSS"]),
            mb(m["served"]["VmRSS"]),
            mb(m["served"]["RssAnon"] - m["baseline"]["RssAnon"]),
            mb(m["served"]["RssShmem"] + m["served"]["RssFile"]),
            mb(m["served"]["USS"]),
            f"{m['anon_overhead_ratio']:.2%}",
            f"{m['index_s']:.1f}",
        ]
        for m in rows
    ]
    header = [
        "spool GB",
        "records",
        "RSS empty MB",
        "RSS indexed MB",
        "RSS after serving all MB",
        "private growth MB",
        "shared (tmpfs/file) MB",
        "USS MB",
        "private growth / spool",
        "index s",
    ]
    return table(header, body)
