"""BENCHMARKS.md and `benchmarks/plots/*.png` from one run's results (`benchmarks/out/results.json`).

    .venv/bin/python -m benchmarks.report [results.json]

Sections 1-6 come only from the results file. Every other section of BENCHMARKS.md (other benchmarks' runs,
the hook costs, the findings and the prose about causes) is kept as the file has it (`kept_sections`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ".venv/bin/python -m benchmarks.run"
# The real-server section has its own run (`make bench-sglang`); both writers keep it between these markers.
REAL_SERVER_BEGIN, REAL_SERVER_END = "<!-- real-server:begin -->", "<!-- real-server:end -->"
RANKS_BEGIN, RANKS_END = "<!-- ranks:begin -->", "<!-- ranks:end -->"
RANKS_INTRO = """## Per-rank fetch and refs through Ray

```bash
.venv/bin/python -m benchmarks.ranks --reps 25   # writes benchmarks/ranks.md; `make bench` keeps it here
```

What one training rank fetches with `service.client.ranks.fetch_rank` (its pipeline stage's layers, its load-balanced
context-parallel chunks, sliced by the sidecar) against the whole record. Rank 0 of each place (DeepSeek-V3's
first stage holds its 3 dense layers, so it fetches fewer MoE layers than a quarter). Bytes are the sidecar's
own count of body bytes served (`r3_served_bytes_total`); time is the median of a kept-alive loopback fetch, the
places interleaved. On loopback the time falls less than the bytes (a request costs ~3 ms here whatever its
size); across a network the bytes are the time. The second table is `pickle.dumps` of the `RoutedExpertsRef` a
trainer ships through Ray's object store instead of the rows.

"""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


# ---- targets ----------------------------------------------------------------------------------------


def targets(results: dict) -> list[list[str]]:
    """Each target: its measured value, the gap to it, met or missed."""
    rows: list[list[str]] = []
    delivery = results.get("delivery", [])
    small = [d for d in delivery if d["model"] in ("Qwen3-30B-A3B", "DeepSeek-V3")]
    if small:
        worst = max(small, key=lambda d: d["bytes_ratio"])
        rows.append(
            [
                "bytes on the wire ≤ 1/5 of inline (≤256 experts)",
                f"worst {worst['bytes_ratio']:.3f} ({worst['model']}, {worst['tokens']})",
                f"{0.2 - worst['bytes_ratio']:+.3f} below the bound",
                _status(worst["bytes_ratio"] <= 0.2),
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
                _status(worst["speedup"] >= 10),
            ]
        )
    conc, lim = results.get("concurrency", []), results.get("limits")
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
                _status(frac >= 0.5),
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
                _status(ok),
            ]
        )
    engine = results.get("engine", {}).get("finish", [])
    if engine:
        ratios = [(e["ours_total"]["p50"] / e["upstream_total"]["p50"], e) for e in engine]
        worst_ratio, worst = max(ratios, key=lambda x: x[0])
        rows.append(
            [
                "scheduler-thread cost per finished request ≤ upstream's",
                f"worst ours/upstream = {worst_ratio:.2f} ({worst['model']}, {worst['tokens']})",
                f"{1 - worst_ratio:+.0%} of upstream's",
                _status(worst_ratio <= 1),
            ]
        )
    for m in results.get("memory", []):
        rows.append(
            [
                f"sidecar RSS overhead ≤ 10% of spool bytes ({m['spool_bytes'] / 1e9:.1f} GB)",
                f"private (anon) growth {m['anon_overhead_ratio']:.2%}; total RSS = {m['rss_over_spool']:.2f}× spool",
                f"{0.10 - m['anon_overhead_ratio']:+.2%} points",
                _status(m["anon_overhead_ratio"] <= 0.10),
            ]
        )
    return rows


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
            f"Single record, single stream: the project's client takes {_ms(ours)} ms, the same GET read by "
            f"`http.client` into a sized buffer {_ms(lean)} ms, a raw socket with no HTTP parsing {_ms(raw)} ms: "
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
            f"{_ms(worst['ours_s']['p50'])} ms = spool write {_ms(worst['ours_write_s']['p50'])} ms + fetch; "
            "with the reference reader "
            f"{_ms(worst['ours_lean_s']['p50'])} ms, {worst['speedup_lean']:.1f}× inline."
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


# ---- sections ----------------------------------------------------------------------------------------


def delivery_section(rows: list[dict]) -> str:
    body = [
        [
            d["model"],
            f"{d['tokens']}",
            _mb(d["inline_bytes"]),
            _mb(d["ours_bytes"]),
            f"{d['bytes_ratio']:.3f}",
            _ms(d["inline_s"]["p50"]),
            _ms(d["inline_server_s"]["p50"]),
            _ms(d["ours_s"]["p50"]),
            _ms(d["ours_write_s"]["p50"]),
            f"{d['speedup']:.1f}×",
            _ms(d["ours_lean_s"]["p50"]),
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
    return _table(header, body)


def concurrency_section(rows: list[dict], lim: dict | None) -> str:
    loop = lim["loopback"]["gbps"] if lim else math.nan
    body = [
        [
            c["mode"],
            str(c["concurrency"]),
            str(c["rids_per_request"]),
            f"{c['gbps']:.3f}",
            f"{c['gbps'] / loop:.0%}" if lim else "n/a",
            _ms(c["latency"]["p50"]),
            _ms(c["latency"]["p99"]),
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
    return _table([*header, "requests", "errors", "cold GB/s", "cold p99/p50", "cold errors"], body)


def limits_section(lim: dict) -> str:
    body = [
        ["numpy copy, one record", _mb(lim["memcpy_record"]["bytes"]), f"{lim['memcpy_record']['gbps']:.2f}"],
        ["numpy copy, whole batch", _mb(lim["memcpy_batch"]["bytes"]), f"{lim['memcpy_batch']['gbps']:.2f}"],
        ["loopback TCP, one connection, streaming", _mb(lim["loopback"]["bytes"]), f"{lim['loopback']['gbps']:.2f}"],
    ]
    trips = lim.get("loopback_round_trips")
    if trips:
        body.append(
            ["loopback TCP, one connection, one record per round trip", _mb(trips["bytes"]), f"{trips['gbps']:.2f}"]
        )
    return _table(["path", "MB moved", "GB/s (median)"], body)


def engine_section(engine: dict) -> str:
    finish = [
        [
            e["model"],
            str(e["tokens"]),
            _ms(e["upstream_gather"]["p50"]),
            _ms(e["upstream_ipc_encode"]["p50"]),
            _ms(e["upstream_total"]["p50"]),
            _ms(e["upstream_total_cpu"]["p50"]),
            _ms(e["ours_total"]["p50"]),
            _ms(e["ours_total_cpu"]["p50"]),
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
        _table(header, finish)
        + "\n\nWith live rows (one row per running request per decode step):\n\n"
        + _table(live_header, live)
    )


def breakdown_section(bd: dict) -> str:
    parts = []
    cs = bd.get("client_stacks")
    if cs:
        body = [
            [name, _ms(v["p50"]), f"{cs['bytes'] / v['p50'] / 1e9:.3f}", str(v["n"])]
            for name, v in cs["stacks"].items()
        ]
        parts.append(
            f"One record ({_mb(cs['bytes'])} MB) from the same sidecar, single stream:\n\n"
            + _table(["client stack", "p50 ms", "GB/s", "reps"], body)
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
            "Finish-time compaction on the scheduler thread (thread CPU time, median):\n\n" + _table(header, body)
        )
    live = bd.get("live_compaction")
    if live:
        body = [[c["model"], str(c["batch"]), f"{c['per_request_us']:.0f}", f"{c['per_step_us']:.0f}"] for c in live]
        header = ["model", "running requests", "per request (`to_spool_rows` each) µs", "once per step + views µs"]
        parts.append("Live rows, compaction of one decode step (thread CPU time, median):\n\n" + _table(header, body))
    return "\n\n".join(parts)


def memory_section(rows: list[dict]) -> str:
    body = [
        [
            f"{m['spool_bytes'] / 1e9:.2f}" + ("" if m["fits"] else f" (wanted {m['wanted_bytes'] / 1e9:.0f})"),
            str(m["records"]),
            _mb(m["baseline"]["VmRSS"]),
            _mb(m["indexed"]["VmRSS"]),
            _mb(m["served"]["VmRSS"]),
            _mb(m["served"]["RssAnon"] - m["baseline"]["RssAnon"]),
            _mb(m["served"]["RssShmem"] + m["served"]["RssFile"]),
            _mb(m["served"]["USS"]),
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
    return _table(header, body)


# ---- plots -------------------------------------------------------------------------------------------


def plots(results: dict, directory: Path) -> list[str]:
    """Write the PNGs; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    names = []

    delivery = results.get("delivery", [])
    if delivery:
        labels = [f"{d['model']}\n{d['tokens'] // 1024}k" for d in delivery]
        x = range(len(delivery))
        for name, inline_key, ours_key, ylabel in (
            ("delivery_seconds.png", "inline_s", "ours_s", "end-to-end seconds (median, log)"),
            ("delivery_bytes.png", "inline_bytes", "ours_bytes", "bytes on the wire (log)"),
        ):
            fig, ax = plt.subplots(figsize=(11, 4.5))

            def val(d: dict, key: str) -> float:
                return d[key]["p50"] if isinstance(d[key], dict) else d[key]

            ax.bar([i - 0.2 for i in x], [val(d, inline_key) for d in delivery], 0.4, label="SGLang inline")
            ax.bar([i + 0.2 for i in x], [val(d, ours_key) for d in delivery], 0.4, label="r3-sidecar")
            ax.set_yscale("log")
            ax.set_xticks(list(x), labels, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.legend()
            ax.set_title("Delivery of one request's routed experts to a numpy array in the trainer")
            fig.tight_layout()
            fig.savefig(directory / name, dpi=110)
            plt.close(fig)
            names.append(name)

    conc, lim = results.get("concurrency", []), results.get("limits")
    if conc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in dict.fromkeys(c["mode"] for c in conc):
            pts = [c for c in conc if c["mode"] == mode]
            label = "sidecar, http.client readinto (reference)" if mode == "lean_get" else f"sidecar, client {mode}"
            ax.plot([c["concurrency"] for c in pts], [c["gbps"] for c in pts], "o-", label=label)
        if lim:
            ax.axhline(lim["loopback"]["gbps"], color="k", ls="--", label="raw loopback TCP")
            ax.axhline(lim["memcpy_batch"]["gbps"], color="gray", ls=":", label="numpy copy")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        levels = sorted({c["concurrency"] for c in conc})
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent fetchers")
        ax.set_ylabel("GB/s")
        ax.legend()
        ax.set_title("Rollout batch fetch throughput")
        fig.tight_layout()
        fig.savefig(directory / "concurrency.png", dpi=110)
        plt.close(fig)
        names.append("concurrency.png")

    engine = results.get("engine", {}).get("finish", [])
    if engine:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for model in dict.fromkeys(e["model"] for e in engine):
            pts = [e for e in engine if e["model"] == model]
            t = [e["tokens"] for e in pts]
            (line,) = ax.plot(t, [e["upstream_total"]["p50"] * 1e3 for e in pts], "o--", label=f"{model} upstream")
            ax.plot(t, [e["ours_total"]["p50"] * 1e3 for e in pts], "s-", color=line.get_color(), label=f"{model} ours")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        tokens = sorted({e["tokens"] for e in engine})
        ax.set_xticks(tokens, [f"{t // 1024}k" if t >= 1024 else str(t) for t in tokens])
        ax.set_xlabel("tokens in the request")
        ax.set_ylabel("scheduler-thread ms per finished request")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(directory / "engine_cost.png", dpi=110)
        plt.close(fig)
        names.append("engine_cost.png")

    mem = results.get("memory", [])
    if mem:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        x = range(len(mem))
        ax.bar([i - 0.3 for i in x], [m["spool_bytes"] / 1e6 for m in mem], 0.2, label="spool bytes")
        ax.bar([i - 0.1 for i in x], [m["served"]["VmRSS"] / 1e6 for m in mem], 0.2, label="sidecar RSS")
        ax.bar([i + 0.1 for i in x], [m["served"]["USS"] / 1e6 for m in mem], 0.2, label="sidecar USS")
        growth = [max(m["served"]["RssAnon"] - m["baseline"]["RssAnon"], 1) / 1e6 for m in mem]
        ax.bar([i + 0.3 for i in x], growth, 0.2, label="private growth over an empty spool")
        ax.set_yscale("log")
        ax.set_xticks(list(x), [f"{m['spool_bytes'] / 1e9:.1f} GB spool" for m in mem])
        ax.set_ylabel("MB (log)")
        ax.legend()
        ax.set_title("Sidecar memory after serving every record once")
        fig.tight_layout()
        fig.savefig(directory / "memory.png", dpi=110)
        plt.close(fig)
        names.append("memory.png")
    return names


# ---- document ----------------------------------------------------------------------------------------


GENERATED = ("## Targets", "## 1. ", "## 2. ", "## 3. ", "## 4. ", "## 5. ", "## 6. ", "## Plots")


def kept_sections(document: str) -> str | None:
    """The sections of an existing BENCHMARKS.md that this run does not generate, verbatim and in order.

    Other benchmarks write them (real server, vLLM, per-rank, hook costs) or they hold readings written by
    hand (findings, GPU step times): regenerating sections 1-6 must not drop them. They start at the first
    heading this module does not write (with the `<!-- …:begin -->` marker above it) and end at the plots.
    """
    lines = document.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("## ") and not line.startswith(GENERATED)), None)
    if start is None:
        return None
    while start > 0 and lines[start - 1].startswith("<!-- ") and lines[start - 1].endswith(":begin -->"):
        start -= 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## Plots")), len(lines))
    kept = lines[start:end]
    if ranks_fragment().exists():  # `benchmarks.ranks` writes its table to a file: refresh it here
        kept = _refreshed_ranks(kept)
    return "\n".join(kept).strip()


def ranks_fragment() -> Path:
    return ROOT / "benchmarks" / "ranks.md"


def _ranks_section() -> str:
    return RANKS_INTRO + ranks_fragment().read_text().strip()


def _refreshed_ranks(lines: list[str]) -> list[str]:
    """The per-rank section between its markers, rebuilt from `benchmarks/ranks.md`."""
    if RANKS_BEGIN not in lines or RANKS_END not in lines:
        return lines
    start, end = lines.index(RANKS_BEGIN), lines.index(RANKS_END)
    section = _ranks_section().splitlines()
    return [*lines[: start + 1], *section, *lines[end:]]


def render(results: dict, plot_names: list[str], plot_dir: str, kept: str | None = None) -> str:
    env, after = results["environment"], results.get("environment_after", {})
    cfg = results["config"]
    out = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/report.py` from one run of the harness. Reproduce with:",
        "",
        "```bash",
        f"make bench        # = {COMMAND}",
        f"{COMMAND} --quick   # seconds, small shapes (harness check only)",
        "```",
        "",
        f"Run at {env['date_utc']} UTC on commit `{env['commit']}`, {results.get('wall_s', 0):.0f} s wall. "
        f"Machine: {env['cpus']} CPUs, {env['mem_total'] / 2**30:.0f} GiB RAM, /dev/shm tmpfs "
        f"{env['shm_total'] / 2**30:.0f} GiB; Python {env['python']}, numpy {env['numpy']}, torch {env['torch']}, "
        f"SGLang {env['sglang']}. Load average (1/5/15 min) before: "
        f"{' / '.join(f'{x:.2f}' for x in env['loadavg'])}, after: "
        f"{' / '.join(f'{x:.2f}' for x in after.get('loadavg', []))}. "
        "Other jobs shared the machine, so every figure is a median over repetitions, and the two paths of "
        "each comparison are measured interleaved in the same run.",
        "",
        "Shapes: Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8, uint8), DeepSeek-V3 (58 MoE of 61 layers, "
        "256 experts, top-8, uint8), Kimi-K2 (60 of 61, 384 experts, top-8, uint16). Routing is the top-k of "
        "seeded router logits over random hidden states (`benchmarks/shapes.py`). A request of N tokens has "
        "N−1 rows, as SGLang returns them.",
        "",
        "## Targets",
        "",
        _table(["target", "measured", "gap", "status"], targets(results)),
        "",
        "Measured decompositions (this run):",
        "",
        *[f"- {line}" for line in analysis(results)],
        "",
    ]
    if "delivery" in results:
        out += [
            "## 1. Delivery per request",
            "",
            "Inline: SGLang 0.5.23's `DetokenizerManager._b64_encode_per_request`, the `meta_info` of a finished "
            "request, `orjson_response`, served by uvicorn in its own process; the trainer parses the body with "
            "orjson and runs `extract_routed_experts_from_meta_info(...).reshape(-1, num_hidden_layers, topk)`. "
            "Ours: compaction of the same int32 rows to the spool dtype, `Spool.writer` append + finalize, the "
            "sidecar (`service.server.api.create_app`, its own uvicorn process) and "
            "`RoutedExpertsClient.get(...).array`. "
            "Both start from the engine's int32 rows and stop at a numpy array; both decode to the same experts "
            "(checked every case). Bytes are the full HTTP response (status line, headers, body). The last two "
            "columns replace the client's fetch by the `http.client` reference reader of section 2 (same spool "
            "write, same sidecar), to show what the client's HTTP stack costs.",
            "",
            delivery_section(results["delivery"]),
            "",
        ]
    if "concurrency" in results:
        out += [
            "## 2. Throughput under concurrency",
            "",
            f"A rollout batch of {cfg['batch_records']} records of {cfg['batch_tokens']} tokens "
            f"({cfg['batch_model']}, uint8) fetched once per round by 1…{max(cfg['concurrency'])} trainer threads, "
            f"each with its own client; `get` takes one rid per request, `get_many` {cfg['get_many_chunk']}. "
            f"Latency is per HTTP request. Main columns: a warm round (each fetcher opened its connection "
            "with one small request before the clock started, as a trainer's fetchers keep theirs); `cold`: the "
            "round before it, where all fetchers open their connections inside the clock. `lean_get` is a "
            "reference, not the project's client: the same GET read by the standard library's `http.client` "
            "straight into a Content-Length-sized buffer and parsed by the client's own `parse_npy`; it separates "
            "what the sidecar serves from what the client's HTTP stack (httpx → httpcore → h11) costs.",
            "",
            concurrency_section(results["concurrency"], results.get("limits")),
            "",
        ]
    if "limits" in results:
        out += ["## 3. The machine's limits for the same bytes", "", limits_section(results["limits"]), ""]
    if "engine" in results:
        out += [
            "## 4. Scheduler-thread cost per finished request",
            "",
            "Upstream: a real `BaseTopkCapturer` host cache and `ReqToTokenPool` (rows at scattered slots), "
            "`get_topk`, then the scheduler's msgpack encoder on the int32 tensor (what `send_output` does on the "
            "scheduler thread before ZMQ; the ZMQ copy itself is not counted). Ours: the plugin's finish-time path "
            "`engine_ext.sglang.collect.Collector.finish` (route, `SpoolWriter.reserve`) + `end_step` (one batched "
            "slot read, the gather, compaction to the MoE layers in the spool dtype, `SpoolWriter.submit`) on the "
            "same host cache; the writer thread's file I/O is waited for outside the clock, and the record it wrote is "
            "compared with the engine's rows. torch runs with one intra-op thread for both (on 2 shared cores its "
            "OpenMP pool only adds scheduling noise). Wall and thread-CPU medians are both shown.",
            "",
            engine_section(results["engine"]),
            "",
        ]
    if "memory" in results:
        out += [
            "## 5. Sidecar memory",
            "",
            "A fresh spool filled with records, a sidecar started on it (its start-up scan indexes them), RSS read "
            "from `/proc/<pid>/status` before and after every record was served once. Pages of spool files the "
            "sidecar reads count in RSS as shared (tmpfs) memory but are the spool's own bytes; the private "
            "(`RssAnon`) growth is what the sidecar adds.",
            "",
            memory_section(results["memory"]),
            "",
        ]
    if "breakdown" in results:
        out += ["## 6. Where the time goes", "", breakdown_section(results["breakdown"]), ""]
    if kept is not None:  # the existing document's other sections, as they are
        out += [kept, ""]
    else:  # a new document: the sections other benchmarks wrote to files
        out += _fragments()
    if plot_names:
        out += ["## Plots", "", *[f"![{n}]({plot_dir}/{n})" for n in plot_names], ""]
    return "\n".join(out)


def _fragments() -> list[str]:
    out: list[str] = []
    real_server = ROOT / "benchmarks" / "real_server.md"
    if real_server.exists():  # written by `make bench-sglang` (benchmarks/real_server.py)
        out += [REAL_SERVER_BEGIN, real_server.read_text().strip(), REAL_SERVER_END, ""]
    vllm_parts = [ROOT / "benchmarks" / f"{name}.md" for name in ("vllm_server", "vllm_payload")]
    if any(p.exists() for p in vllm_parts):  # written by benchmarks/vllm_server.py and vllm_payload.py
        vllm = "\n\n".join(p.read_text().strip() for p in vllm_parts if p.exists())
        out += ["<!-- vllm-server:begin -->", vllm, "<!-- vllm-server:end -->", ""]
    if ranks_fragment().exists():  # written by `python -m benchmarks.ranks`, with its introduction
        out += [RANKS_BEGIN, _ranks_section(), RANKS_END, ""]
    return out


def write_report(results: dict, md_path: Path, plot_dir: Path) -> None:
    """Sections 1-6 and the plots from `results`; every other section of an existing `md_path` kept."""
    names = plots(results, plot_dir)
    rel = plot_dir.resolve().relative_to(md_path.resolve().parent)
    kept = kept_sections(md_path.read_text()) if md_path.exists() else None
    md_path.write_text(render(results, names, str(rel), kept))


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "out" / "results.json"
    write_report(orjson.loads(path.read_bytes()), ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "plots")


if __name__ == "__main__":
    main()
