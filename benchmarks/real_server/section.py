"""The "Real SGLang server" section of BENCHMARKS.md from a real-server run's results (`runner.py`): every figure
from the results file, read against the targets, and the section put between its markers in the document
(`splice`), where `benchmarks/report/document.py` keeps it when it regenerates the rest.
"""

from __future__ import annotations

from typing import Any

from benchmarks.real_server.workloads import MODES
from benchmarks.report import REAL_SERVER_BEGIN as BEGIN
from benchmarks.report import REAL_SERVER_END as END

COMMAND = ".venv/bin/python -m benchmarks.real_server"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _range(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _status(ok: bool) -> str:
    return "met" if ok else "**missed**"


def targets(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, label in (("sidecar", "sidecar mode"), ("live", "sidecar mode + live rows")):
        r = s["throughput_ratio"][mode]
        rows.append(
            [
                f"output tokens/s, {label} ÷ upstream ≥ 0.99",
                f"median {r['median']:.3f}, range {r['min']:.3f}–{r['max']:.3f} over {r['n']} reps",
                f"{r['median'] - 0.99:+.3f}",
                _status(r["median"] >= 0.99),
            ]
        )
        c = s["cpu_ratio"][mode]
        rows.append(
            [
                f"output tokens per server CPU second, {label} ÷ upstream ≥ 0.99",
                f"median {c['median']:.3f}, range {c['min']:.3f}–{c['max']:.3f} over {c['n']} reps",
                f"{c['median'] - 0.99:+.3f}",
                _status(c["median"] >= 0.99),
            ]
        )
    itl = s["itl"]["sidecar"]
    rows.append(
        [
            "ITL p99/p50 ≤ 1.2 in sidecar mode while long requests finish",
            f"{itl['p99_over_p50']:.2f} pooled; per rep {_range(itl['p99_over_p50_per_rep'], '{:.2f}')}",
            f"{1.2 - itl['p99_over_p50']:+.2f} below 1.2",
            _status(itl["p99_over_p50"] <= 1.2),
        ]
    )
    return rows


def itl_rows(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode in MODES:
        i = s["itl"][mode]
        at, other = i["at_finish"], i["elsewhere"]
        rows.append(
            [
                mode,
                _ms(i["pooled"]["p50"]),
                _ms(i["pooled"]["p99"]),
                f"{i['p99_over_p50']:.2f}",
                _range(i["p99_over_p50_per_rep"], "{:.2f}"),
                _ms(i["pooled"]["max"]),
                f"{_ms(at['p50'])} / {_ms(at['max'])} ({at['n']})" if at else "n/a",
                f"{_ms(other['p50'])} / {_ms(other['p99'])} ({other['n']})" if other else "n/a",
                str(i["finishes"]),
            ]
        )
    return rows


def render_section(results: dict[str, Any]) -> str:
    """The "Real SGLang server" section: numbers from `results` only, read against the targets."""
    s, b = results["summary"], results["bench"]
    return "\n".join(
        [
            *_how_it_ran(results),
            "### Targets",
            "",
            _table(["target", "measured", "gap", "status"], targets(s)),
            "",
            *_throughput_part(s, b),
            *_itl_part(s, b),
            *_lag_part(s),
            *reading(results),
        ]
    )


def _how_it_ran(results: dict[str, Any]) -> list[str]:
    """The heading, how to reproduce, and the run's machine, model and order of work."""
    b, env, after = results["bench"], results["environment"], results["environment_after"]
    load = " / ".join(f"{x:.2f}" for x in env["loadavg"])
    load_after = " / ".join(f"{x:.2f}" for x in after["loadavg"])
    return [
        "## Real SGLang server",
        "",
        "The plugin inside a real SGLang 0.5.23 server on this CPU machine (`benchmarks/real_server/`, the "
        "real-engine suite's harness). Reproduce with:",
        "",
        "```bash",
        f"make bench-sglang   # = {COMMAND}   (writes this section; `make bench` keeps it)",
        "```",
        "",
        f"Run at {env['date_utc']} UTC on commit `{env['commit']}`, {results['wall_s']:.0f} s wall "
        f"({results['start_s']:.0f} s of it starting the three servers). Machine: {env['cpus']} CPUs shared "
        f"with other jobs; load average (1/5/15 min) before: {load}, after: {load_after}.",
        "",
        f"Model: tiny random-weight Qwen3-MoE, {b['layers']} MoE layers, {b['experts']} experts, top-{b['topk']}, "
        f"hidden 64, one attention head (`--load-format dummy`, torch_native attention, `OMP_NUM_THREADS=1`, "
        "`--sleep-on-idle`). Three servers run side by side: `upstream` (plugin not loaded: SGLang's inline "
        '`meta_info["routed_experts"]`), `sidecar` (plugin, `R3_MODE=sidecar`), `live` (plugin, '
        f"`R3_LIVE_ROWS=1`). Each of {b['reps']} repetitions runs every workload on every server, one server at "
        "a time, in a rotated order (ABC, BCA, CAB); every request asks for routed experts. Ratios are taken "
        "within a repetition; the figures are medians with the range over repetitions in parentheses.",
        "",
    ]


def _throughput_part(s: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """(a): output tokens per wall second and per CPU second, and the CPU each process spent per token."""
    tp = [
        [
            m,
            _range(s["tok_s"][m], "{:.1f}"),
            _range(s["tok_per_cpu_s"][m], "{:.1f}"),
            _range(s["server_cpu_ms_per_token"][m], "{:.2f}"),
            _range(s["sidecar_cpu_ms_per_token"][m], "{:.2f}"),
        ]
        for m in MODES
    ]
    return [
        f"### (a) Throughput: {b['streams']} concurrent requests, {b['prompt']} prompt + {b['output']} output "
        "tokens, greedy, `ignore_eos`",
        "",
        "Each repetition runs the batch twice per mode, in the order ABC CBA; a mode's figure is its tokens "
        "over its summed time. *Per server CPU second*: tokens over the CPU time (user + system, from "
        "`/proc`) of every process of the stack, the sidecar's included, during the batch: on a machine "
        "shared with other jobs this is the steadier measure of what the plugin costs.",
        "",
        _table(
            [
                "mode",
                "output tokens/s (wall)",
                "output tokens per CPU second (server + sidecar)",
                "SGLang processes CPU ms per token",
                "sidecar process CPU ms per token",
            ],
            tp,
        ),
        "",
    ]


def _itl_part(s: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """(b): the gaps between stream chunks while long requests finish, at a finish and elsewhere."""
    return [
        f"### (b) Inter-token latency of {b['streams']} streams while {b['long_requests']} long requests finish",
        "",
        f"Long requests: {b['long_context']}-token prompts (about {s['long_tokens']['median']:.0f} tokens "
        f"when they finish; upstream's inline payload {s['long_inline_b64_bytes']['median'] / 1e6:.2f} MB of "
        f"base64 each), {b['long_first']} + k·{b['long_stagger']} output tokens, so they finish one after "
        "another. They are prefilled before the window opens (torch_native prefill is O(context²) on CPU and "
        "would otherwise dominate every tail); the window holds only decode steps and the finishes, and ends "
        "0.5 s after the last one. ITL = time between consecutive `stream=true` chunks of a stream, measured "
        "by the client. A gap is *at a finish* when a long request's last chunk arrived within it or within "
        "one median gap of it.",
        "",
        _table(
            [
                "mode",
                "p50 ms",
                "p99 ms",
                "p99/p50 pooled",
                "p99/p50 per rep",
                "max ms",
                "at a finish: p50 / max ms (gaps)",
                "elsewhere: p50 / p99 ms (gaps)",
                "finishes",
            ],
            itl_rows(s),
        ),
        "",
    ]


def _lag_part(s: dict[str, Any]) -> list[str]:
    """(c): from SGLang sending a response to the spool record being final."""
    lag = [
        [m, *(_ms(s["lag_s"][m][k]) for k in ("min", "p50", "p90", "p99", "max")), str(s["lag_s"][m]["n"])]
        for m in ("sidecar", "live")
    ]
    return [
        "### (c) Finish → record final in the spool",
        "",
        "Spool record `updated` (set when the writer thread finalises it) minus SGLang's "
        "`response_sent_to_client_ts` for the same request; both are server-side wall clocks on one host. "
        "Negative: the record was final before SGLang sent the response. The requests of (a) "
        "(SGLang stamps a streamed response's first chunk, not its last, so (b)'s are left out).",
        "",
        _table(["mode", "min ms", "p50 ms", "p90 ms", "p99 ms", "max ms", "requests"], lag),
        "",
    ]


def reading(results: dict[str, Any]) -> list[str]:
    """What this run's numbers say, computed from them (no figure here comes from anywhere else)."""
    s = results["summary"]
    out = ["### Reading (computed from this run)", ""]
    b = results["bench"]
    out.append(
        f"- Context: {b['long_context']} tokens per long request, the low end of the 2k–16k asked for. SGLang's "
        "CPU attention (torch_native) prefills in O(context²): a probe with 16k-token prompts on this machine "
        "(load 5–8) took minutes per prompt, which does not fit a 10-minute benchmark."
    )
    for mode in ("sidecar", "live"):
        w, c = s["throughput_ratio"][mode], s["cpu_ratio"][mode]
        out.append(
            f"- Throughput, {mode} ÷ upstream: {w['median']:.3f} by wall time (range {w['min']:.3f}–{w['max']:.3f}), "
            f"{c['median']:.3f} per server CPU second (range {c['min']:.3f}–{c['max']:.3f})."
        )
    for mode in MODES:
        i = s["itl"][mode]
        at, other = i["at_finish"], i["elsewhere"]
        if not (at and other):
            continue
        tail = (
            "at finishes"
            if at["max"] >= other["p99"]
            else "away from finishes (the machine's load, not the finish path)"
        )
        out.append(
            f"- ITL, {mode}: gaps at a finish have median {_ms(at['p50'])} ms against {_ms(other['p50'])} ms elsewhere "
            f"({at['p50'] / other['p50'] - 1:+.0%}); the largest gap at a finish is {_ms(at['max'])} ms, the p99 "
            f"elsewhere {_ms(other['p99'])} ms, so the pooled p99 ({_ms(i['pooled']['p99'])} ms) is set {tail}."
        )
    for mode in ("sidecar", "live"):
        lag = s["lag_s"][mode]
        out.append(
            f"- Finish → final, {mode}: p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms "
            f"after SGLang sent the response ({lag['n']} requests)."
        )
    return out


def splice(document: str, section: str) -> str:
    """Put `section` between the markers in `document`: replace the old block, else insert it before the
    findings (or at the end). `benchmarks/report/document.py` includes the same fragment, so either writer keeps it."""
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    anchor = "## Findings"
    if anchor in document:
        head, tail = document.split(anchor, 1)
        return f"{head}{block}\n\n{anchor}{tail}"
    return document.rstrip("\n") + "\n\n" + block + "\n"
