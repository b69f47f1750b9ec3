"""BENCHMARKS.md and `benchmarks/plots/*.png` from one run's results (`benchmarks/out/results.json`).

    .venv/bin/python -m benchmarks.report [results.json]

Sections 1-6 come only from the results file. Every other section of BENCHMARKS.md (other benchmarks' runs,
the hook costs, the findings and the prose about causes) is kept as the file has it (`kept_sections`).
This module writes the document; the targets are `targets.py`'s, the sections' tables `tables.py`'s and
the plots `plots.py`'s (this folder's). `python -m benchmarks.report` runs `main` (`__main__.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from benchmarks.report.plots import plots
from benchmarks.report.tables import (
    breakdown_section,
    concurrency_section,
    delivery_section,
    engine_section,
    limits_section,
    memory_section,
    table,
)
from benchmarks.report.targets import analysis, targets

ROOT = Path(__file__).resolve().parents[2]
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

# What sections 1, 4 and 5 measured, above their tables.
DELIVERY_INTRO = (
    "Inline: SGLang 0.5.23's `DetokenizerManager._b64_encode_per_request`, the `meta_info` of a finished "
    "request, `orjson_response`, served by uvicorn in its own process; the trainer parses the body with "
    "orjson and runs `extract_routed_experts_from_meta_info(...).reshape(-1, num_hidden_layers, topk)`. "
    "Ours: compaction of the same int32 rows to the spool dtype, `Spool.writer` append + finalize, the "
    "sidecar (`service.server.api.create_app`, its own uvicorn process) and "
    "`RoutedExpertsClient.get(...).array`. "
    "Both start from the engine's int32 rows and stop at a numpy array; both decode to the same experts "
    "(checked every case). Bytes are the full HTTP response (status line, headers, body). The last two "
    "columns replace the client's fetch by the `http.client` reference reader of section 2 (same spool "
    "write, same sidecar), to show what the client's HTTP stack costs."
)
ENGINE_INTRO = (
    "Upstream: a real `BaseTopkCapturer` host cache and `ReqToTokenPool` (rows at scattered slots), "
    "`get_topk`, then the scheduler's msgpack encoder on the int32 tensor (what `send_output` does on the "
    "scheduler thread before ZMQ; the ZMQ copy itself is not counted). Ours: the plugin's finish-time path "
    "`engine_ext.sglang.collect.Collector.finish` (route, `SpoolWriter.reserve`) + `end_step` (one batched "
    "slot read, the gather, compaction to the MoE layers in the spool dtype, `SpoolWriter.submit`) on the "
    "same host cache; the writer thread's file I/O is waited for outside the clock, and the record it wrote is "
    "compared with the engine's rows. torch runs with one intra-op thread for both (on 2 shared cores its "
    "OpenMP pool only adds scheduling noise). Wall and thread-CPU medians are both shown."
)
MEMORY_INTRO = (
    "A fresh spool filled with records, a sidecar started on it (its start-up scan indexes them), RSS read "
    "from `/proc/<pid>/status` before and after every record was served once. Pages of spool files the "
    "sidecar reads count in RSS as shared (tmpfs) memory but are the spool's own bytes; the private "
    "(`RssAnon`) growth is what the sidecar adds."
)


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
    """The whole document: the run and its targets, sections 1-6, the kept sections (a new document: the
    fragments other benchmarks wrote), then the plots."""
    out = [*_head(results), *_measured_sections(results)]
    if kept is not None:  # the existing document's other sections, as they are
        out += [kept, ""]
    else:  # a new document: the sections other benchmarks wrote to files
        out += _fragments()
    if plot_names:
        out += ["## Plots", "", *[f"![{n}]({plot_dir}/{n})" for n in plot_names], ""]
    return "\n".join(out)


def _head(results: dict) -> list[str]:
    """The title, how to reproduce, the machine and the shapes; the targets and what they decompose into."""
    env, after = results["environment"], results.get("environment_after", {})
    return [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/report/document.py` from one run of the harness. Reproduce with:",
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
        table(["target", "measured", "gap", "status"], targets(results)),
        "",
        "Measured decompositions (this run):",
        "",
        *[f"- {line}" for line in analysis(results)],
        "",
    ]


def _measured_sections(results: dict) -> list[str]:
    """Sections 1-6, each where the run measured it: its heading, what was measured, its table."""
    cfg = results["config"]
    out: list[str] = []
    if "delivery" in results:
        out += ["## 1. Delivery per request", "", DELIVERY_INTRO, "", delivery_section(results["delivery"]), ""]
    if "concurrency" in results:
        out += [
            "## 2. Throughput under concurrency",
            "",
            _concurrency_intro(cfg),
            "",
            concurrency_section(results["concurrency"], results.get("limits")),
            "",
        ]
    if "limits" in results:
        out += ["## 3. The machine's limits for the same bytes", "", limits_section(results["limits"]), ""]
    if "engine" in results:
        out += ["## 4. Scheduler-thread cost per finished request", "", ENGINE_INTRO, ""]
        out += [engine_section(results["engine"]), ""]
    if "memory" in results:
        out += ["## 5. Sidecar memory", "", MEMORY_INTRO, "", memory_section(results["memory"]), ""]
    if "breakdown" in results:
        out += ["## 6. Where the time goes", "", breakdown_section(results["breakdown"]), ""]
    return out


def _concurrency_intro(cfg: dict) -> str:
    """What section 2 fetched, how, and what its reference reader separates."""
    return (
        f"A rollout batch of {cfg['batch_records']} records of {cfg['batch_tokens']} tokens "
        f"({cfg['batch_model']}, uint8) fetched once per round by 1…{max(cfg['concurrency'])} trainer threads, "
        f"each with its own client; `get` takes one rid per request, `get_many` {cfg['get_many_chunk']}. "
        f"Latency is per HTTP request. Main columns: a warm round (each fetcher opened its connection "
        "with one small request before the clock started, as a trainer's fetchers keep theirs); `cold`: the "
        "round before it, where all fetchers open their connections inside the clock. `lean_get` is a "
        "reference, not the project's client: the same GET read by the standard library's `http.client` "
        "straight into a Content-Length-sized buffer and parsed by the client's own `parse_npy`; it separates "
        "what the sidecar serves from what the client's HTTP stack (httpx → httpcore → h11) costs."
    )


def _fragments() -> list[str]:
    out: list[str] = []
    real_server = ROOT / "benchmarks" / "real_server.md"
    if real_server.exists():  # written by `make bench-sglang` (benchmarks/real_server/)
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
