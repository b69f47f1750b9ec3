"""What a GPU server run ran on, and its BENCHMARKS.md fragment (`gpu_servers.md`): card, versions, checks, A/B."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

# Printed by the servers' python: the versions that served, read the way each package reports itself
PROBE = """
import importlib.metadata as md, json, torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    **{n: v(n) for n in ("sglang", "sglang-kernel", "flashinfer-python", "transformers", "tokenizers", "triton")},
}))
"""


def environment(python: str) -> dict[str, Any]:
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True).stdout
    env = json.loads(out.strip().splitlines()[-1])
    env["nvidia_smi"] = None
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        env["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    return env


def _interval(s: dict[str, Any]) -> str:
    return (
        f"{s['geomean']:.4f} (95% t-interval {s['t95'][0]:.4f}–{s['t95'][1]:.4f}; "
        f"bootstrap of the mean {s['bootstrap95'][0]:.4f}–{s['bootstrap95'][1]:.4f})"
    )


def _tok_s(rounds: list[dict[str, Any]], mode: str) -> float:
    rates = sorted(r[mode]["tokens"] / r[mode]["wall_s"] for r in rounds)
    return rates[len(rates) // 2] if rates else float("nan")


def ab_lines(results: dict[str, Any]) -> list[str]:
    ab, plan = results.get("ab"), results["plan"]
    if not ab or not ab.get("rounds"):
        skipped = (ab or {}).get("skipped")
        return [f"No A/B rounds ran: skipped, {skipped}." if skipped else "No A/B rounds ran."]
    bench, summary = plan["ab"], ab["summary"]
    shape = (
        "Qwen3-30B-A3B's layer shape (hidden 2048; 32 query and 4 KV heads of 128; 128 experts of 768, top 8), "
        f"{bench['layers']} of its 48 layers, `--load-format dummy`, bfloat16"
        if plan["gpu"]
        else f"a tiny Qwen3-MoE ({bench['layers']} layers, {bench['experts']} experts, top {bench['topk']})"
    )
    rounds = ab["rounds"]
    modes = [mode for mode in ("off", "upstream", "sidecar") if mode in rounds[0]]
    three = "off" in modes
    blank = [""] * len(modes)

    def row(label: str, cells: list[str]) -> str:
        return "| " + " | ".join([label, *cells]) + " |"

    lines = [
        f"Paired A/B{'/C' if three else ''}: "
        + ("routed experts off (`off`), " if three else "")
        + f"SGLang's inline routed experts (`upstream`, plugin off), sidecar mode (`R3_MODE=sidecar`): {shape}; "
        f"{bench['streams']} concurrent requests of {bench['prompt']} prompt + {bench['output']} output tokens, "
        f"greedy, `return_routed_experts` where the capture is on; {summary['tok_s']['n']} rounds, each in a "
        "rotated order",
        "",
        row("", [f"{mode} tok/s (median round)" for mode in modes] + ["ratio, geometric mean"]),
        "|" + "---|" * (len(modes) + 2),
        row(
            "sidecar ÷ upstream, output tokens/s",
            [f"{_tok_s(rounds, mode):.0f}" for mode in modes] + [_interval(summary["tok_s"])],
        ),
        row("sidecar ÷ upstream, per server CPU second", [*blank, _interval(summary["tok_per_cpu_s"])]),
    ]
    if three:
        lines.append(row("upstream ÷ off, output tokens/s", [*blank, _interval(summary["inline_vs_off"])]))
        lines.append(row("sidecar ÷ off, output tokens/s", [*blank, _interval(summary["sidecar_vs_off"])]))
    return lines


def fragment(results: dict[str, Any]) -> str:
    env, plan = results.get("environment", {}), results["plan"]
    checks = results.get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    where = env.get("nvidia_smi") or env.get("gpu") or "CPU (rehearsal)"
    lines = [
        f"### Real SGLang {results.get('version')} servers {'on a GPU' if plan['gpu'] else '(CPU rehearsal)'}",
        "",
        f"{where}; torch {env.get('torch')} (CUDA {env.get('cuda')}), SGLang {env.get('sglang')}, sglang-kernel "
        f"{env.get('sglang-kernel')}, flashinfer-python {env.get('flashinfer-python')}, transformers "
        f"{env.get('transformers')}, triton {env.get('triton')}. Command: `tests/engine/gpu/run_servers.sh "
        f".gpu-{results.get('version')}` (tests/engine/gpu/README.md); phases (s from start): "
        f"{json.dumps(results.get('phases', {}))}.",
        "",
        "Launch: SGLang's defaults (CUDA graphs, piecewise CUDA graphs, overlap scheduling) but `--attention-backend "
        "triton --sampling-backend pytorch --grammar-backend none` (those kernels are not carried) and a KV cap per "
        "server (`tests/e2e/sglang_server.py`, `GPU_ARGS`)."
        if plan["gpu"]
        else "Launch: the CPU suite's (`tests/e2e/sglang_server.py`, `BASE_ARGS` and the version's flags).",
        "",
        f"Upstream vs mirror vs sidecar on the tiny seeded Qwen3-MoE (head_dim 64): **{len(checks) - len(failed)} of "
        f"{len(checks)} checks passed**"
        + (": every record is SGLang's inline payload byte for byte." if not failed else "."),
    ]
    lines += [f"- FAILED {c['check']}: {c['detail'][:300]}" for c in failed]
    graphs = results.get("graphs", {})
    if graphs:
        lines += [
            "",
            "Graph evidence from SGLang's logs (captured decode sizes; graph flags of the bs-3 decode lines "
            "and of the long prompt's prefill):",
            "",
        ]
        lines += [
            f"- {name}: decode {g['decode_sizes']}, piecewise up to "
            f"{max(g['prefill_sizes']) if g['prefill_sizes'] else None} tokens; bs 3 {g['decode_at_3']}; "
            f"{g['long_prompt']}-token prefill {g['long_prefill']}"
            for name, g in graphs.items()
        ]
    return "\n".join([*lines, "", *ab_lines(results), ""])
