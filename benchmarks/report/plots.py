"""The PNGs under `benchmarks/plots/` from one run's results, each beside the section of BENCHMARKS.md it draws
(`benchmarks/report/document.py` links them under "Plots"). matplotlib is imported only when plots are drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plots(results: dict, directory: Path) -> list[str]:
    """Write the PNGs; return their file names."""
    import matplotlib

    matplotlib.use("Agg")

    directory.mkdir(parents=True, exist_ok=True)
    names = []
    delivery = results.get("delivery", [])
    if delivery:
        names += _delivery_plots(delivery, directory)
    conc, lim = results.get("concurrency", []), results.get("limits")
    if conc:
        names.append(_concurrency_plot(conc, lim, directory))
    engine = results.get("engine", {}).get("finish", [])
    if engine:
        names.append(_engine_plot(engine, directory))
    mem = results.get("memory", [])
    if mem:
        names.append(_memory_plot(mem, directory))
    return names


def _save(fig: Any, directory: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(directory / name, dpi=110)
    plt.close(fig)
    return name


def _delivery_plots(delivery: list[dict], directory: Path) -> list[str]:
    """Section 1: seconds and bytes of one request's delivery, inline against ours, per model and length."""
    import matplotlib.pyplot as plt

    names = []
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
        names.append(_save(fig, directory, name))
    return names


def _concurrency_plot(conc: list[dict], lim: dict | None, directory: Path) -> str:
    """Section 2: batch fetch throughput per number of fetchers, against loopback TCP and a numpy copy."""
    import matplotlib.pyplot as plt

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
    return _save(fig, directory, "concurrency.png")


def _engine_plot(engine: list[dict], directory: Path) -> str:
    """Section 4: the scheduler thread's ms per finished request by request length, upstream's and ours."""
    import matplotlib.pyplot as plt

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
    return _save(fig, directory, "engine_cost.png")


def _memory_plot(mem: list[dict], directory: Path) -> str:
    """Section 5: spool bytes against the sidecar's RSS, USS and private growth, per spool size."""
    import matplotlib.pyplot as plt

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
    return _save(fig, directory, "memory.png")
