"""`make bench-hooks`: what each capture hook adds to SGLang's own code path, on SGLang 0.5.23's real classes.

    .venv/bin/python -m benchmarks.hooks            # ~2 minutes; benchmarks/out/hooks.json and a table
    .venv/bin/python -m benchmarks.hooks --quick    # fewer shapes and repeats
    python3 -m benchmarks.hooks --device cuda       # the capturer and its tensors on a GPU (see BENCHMARKS.md)

Each variant runs in its own interpreter, because `HookRegistry` patches SGLang's classes in place:
`upstream` (no plugin hook: only a `_forward_raw` stand-in through the same registry), `timers_on` (the
plugin's capture hooks, `R3_HOOK_TIMERS=1`, the default) and `timers_off`. Per forward, on one DP rank:

- `extent`: `ModelRunner._forward_raw` (a model body that does nothing) through the registry: what
  `_record_forward_extent` adds per forward;
- `layers`: the real capture site `topk.capture_routed_experts_if_allowed` → `RoutedExpertsCapturer.capture`
  → `BaseDeviceCache.capture` for every layer: what `_checked_device_capture` adds per eager forward (it runs
  inside the model's forward, so no runtime timer can see it: a clock there is what Dynamo cannot trace);
- `compiled` (DP 1 decode shapes, `--device cpu` only): the same layers as one `torch.compile(fullgraph=True)`
  forward (Inductor), as piecewise CUDA graphs and `--enable-torch-compile` run them: the graph is
  upstream's op for op (`tests/engine/sglang/test_capture_compiled.py`), so what is left is Dynamo's guards;
- `end`: `RoutedExpertsCapturer.on_forward_end` in overlap mode (SGLang's default: device clones of the
  slice), with the plugin's `_get_local_slice` and `_around_forward_end` (occupancy, DP slicing).

Shapes of real deployments: decode batches of 1-512 tokens per rank and 8k-token prefill chunks; 48 and
94 layers (Qwen3-30B-A3B, Qwen3-235B-A22B), 128 experts, top-8; DP 1, and DP 8 with DP attention (the MoE
routes the gathered batch: 8x the rows). The per-finished-request cost is section 4 of BENCHMARKS.md
(`benchmarks/engine_cost.py`); the per-batch-result hooks are timed on the real server (engine file `hooks`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.environment import environment

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "hooks.json"
TINY = ROOT / "tests" / "sglang_cpu" / "tiny_qwen3moe" / "config.json"
SHAPES = [  # (dp, kind, tokens per rank)
    (1, "decode", 1),
    (1, "decode", 64),
    (1, "decode", 512),
    (1, "extend", 8192),
    (8, "decode", 1),
    (8, "decode", 64),
    (8, "decode", 512),
    (8, "extend", 8192),
]
LAYERS = (48, 94)


def _model_dir(tmp: Path, layers: int) -> Path:
    config = json.loads(TINY.read_text())
    config |= {"num_hidden_layers": layers, "num_experts": 128, "num_experts_per_tok": 8}
    config |= {"max_position_embeddings": 32768}
    path = tmp / f"model-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _no_sync() -> None:
    return None


_SYNC = [_no_sync]  # on CUDA, `torch.cuda.synchronize`: a block's time then includes the kernels it queued


def _block_ns(fn, number: int) -> float:
    _SYNC[0]()
    t0 = time.perf_counter_ns()
    for _ in range(number):
        fn()
    _SYNC[0]()
    return (time.perf_counter_ns() - t0) / number


_SHAPE: dict[str, Any] = {}


def _model_body(runner, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    """`_forward_raw` without a model: what `_prepare_eager_forward_batch` leaves for the capturer under DP."""
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    dp, tokens = _SHAPE["dp"], _SHAPE["tokens"]
    if dp > 1:  # prepare_mlp_sync_batch: a new padded list each forward
        forward_batch.global_num_tokens_padded_cpu = [tokens] * dp
    return ModelRunnerOutput(logits_output=None, can_run_graph=False)


def _variants(before: str | None) -> dict[str, dict[tuple[type, str], Any]]:
    """Each variant as the class attributes it sets: upstream's functions, or them wrapped by the plugin's
    hooks through SGLang's own `HookRegistry` wrapper (`_wrap_fn`), as `apply_hooks` would."""
    import importlib.util

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.state_capturer.base import BaseDeviceCache
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    from engine_ext.sglang.hooks import table

    modules = {"timers_on": table, "timers_off": table}
    if before:
        spec = importlib.util.spec_from_file_location("r3_hooks_before", Path(before) / "engine_ext" / "hooks.py")
        modules["before"] = sys.modules["r3_hooks_before"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["before"])
    upstream = {
        (ModelRunner, "_forward_raw"): _model_body,
        (BaseDeviceCache, "capture"): BaseDeviceCache.capture,
        (RoutedExpertsCapturer, "_get_local_slice"): RoutedExpertsCapturer._get_local_slice,
        (RoutedExpertsCapturer, "on_forward_end"): RoutedExpertsCapturer.on_forward_end,
    }
    hooked = {
        (ModelRunner, "_forward_raw"): ("_record_forward_extent", HookType.AROUND),
        (BaseDeviceCache, "capture"): ("_checked_device_capture", HookType.AROUND),
        (RoutedExpertsCapturer, "_get_local_slice"): ("_get_local_slice", HookType.REPLACE),
        (RoutedExpertsCapturer, "on_forward_end"): ("_around_forward_end", HookType.AROUND),
    }
    out = {"upstream": upstream}
    for variant, module in modules.items():
        out[variant] = {}
        for key, (name, kind) in hooked.items():
            fn = module.body(name) if hasattr(module, "body") else getattr(module, name)  # rooms, or one hooks.py
            if variant == "timers_off":
                fn = getattr(fn, "__r3_untimed__", fn)
            out[variant][key] = _wrap_fn(upstream[key], fn, kind)
    return out


def one_shape(
    variants: dict, layers: int, dp: int, kind: str, tokens: int, rounds: int, device: str = "cpu"
) -> dict[str, Any]:
    """One shape: a fresh published config, capturer and batch; the variants interleaved, least of `rounds`."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args

    from engine_ext.sglang import capturer, timers
    from engine_ext.sglang.hooks import capture as capture_hooks

    _SHAPE.update(dp=dp, tokens=tokens)
    gathered = tokens * dp  # DP attention: every rank's MoE routes the gathered batch
    server = {"enable_return_routed_experts": True, "chunked_prefill_size": 8192, "max_running_requests": 512}
    if dp > 1:
        server |= {"tp_size": dp, "attn_dp_size": dp}
    publish_args(world_rank=min(1, dp - 1), **server)
    with tempfile.TemporaryDirectory() as tmp:
        model_config = ModelConfig(str(_model_dir(Path(tmp), layers)))
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = capture_hooks._create_sized_capturer(  # the plugin's sizing, for every variant (its slicing reads it)
        RoutedExpertsCapturer.create,
        model=model,
        model_config=model_config,
        num_tokens=8192,
        max_running_requests=512,
        device=device,
    )
    set_global_experts_capturer(cap)
    runner = ModelRunner.__new__(ModelRunner)
    runner.decode_cuda_graph_runner = None
    mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=tokens if kind == "decode" else 1,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
        seq_lens=torch.ones(1, dtype=torch.int64, device=device),
        out_cache_loc=torch.arange(tokens, dtype=torch.int64, device=device),
        seq_lens_sum=tokens,
    )
    fb.global_num_tokens_cpu = [tokens] * dp if dp > 1 else None
    topk = torch.randint(0, 128, (gathered, 8), dtype=torch.int32, device=device)
    config = TopKConfig(top_k=8)

    def extent() -> None:
        runner._forward_raw(fb, None)

    def body() -> None:
        for layer in range(layers):
            capture_routed_experts_if_allowed(config, layer, topk)

    def end() -> None:
        cap.on_forward_end(forward_batch=fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)

    def forward() -> None:
        extent(), body(), end()

    parts = {"extent_ns": (extent, 200), "layers_ns": (body, 20 if gathered <= 512 else 2), "end_ns": (end, 50)}
    best: dict[str, dict[str, float]] = {v: dict.fromkeys(parts, float("inf")) for v in variants}
    capturer.ROUTED_LAYERS = capturer.RoutedLayers()  # this shape's model, learnt at the first forward
    for r in range(rounds):
        for v in list(variants)[r % 2 :] + list(variants)[: r % 2]:  # alternate which variant goes first
            for (cls, name), fn in variants[v].items():
                setattr(cls, name, fn)
            timers.configure(v != "timers_off")
            forward()  # a whole forward first: the next one starts as a new forward would
            for part, (fn, number) in parts.items():
                best[v][part] = min(best[v][part], _block_ns(fn, number))
    best["per_layer_hook_ns"] = _per_layer_hook_ns(variants, cap, topk, rounds)
    if dp == 1 and kind == "decode" and device == "cpu":  # one compile per variant and shape (CPU Inductor)
        best["compiled_ns"] = _compiled_ns(variants, body, rounds)
    set_global_experts_capturer(None)
    return best


def _compiled_ns(variants: dict, body, rounds: int) -> dict[str, float]:
    """The layers' captures as one compiled forward (Inductor, `fullgraph=True`), upstream's and the plugin's."""
    import torch
    from sglang.srt.state_capturer.base import BaseDeviceCache

    compiled, out = {}, {}
    for v in ("upstream", "timers_on"):
        BaseDeviceCache.capture = variants[v][(BaseDeviceCache, "capture")]
        compiled[v] = torch.compile(lambda: body(), fullgraph=True)
        compiled[v]()  # compile; later calls pick their entry by the guards on `BaseDeviceCache.capture`
    for r in range(rounds):
        for v in ("upstream", "timers_on")[r % 2 :] + ("upstream", "timers_on")[: r % 2]:
            BaseDeviceCache.capture = variants[v][(BaseDeviceCache, "capture")]
            out[v] = min(out.get(v, float("inf")), _block_ns(compiled[v], 20))
    return out


def _per_layer_hook_ns(variants: dict, cap, topk, rounds: int) -> dict[str, float]:
    """The per-layer hook's own cost in a steady forward, alone: SGLang's wrapper and the hook around a
    no-op capture, less the no-op called directly (the tensor copy's noise on a shared machine is larger
    than the hook)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.state_capturer.base import BaseDeviceCache

    from engine_ext.sglang import timers

    def noop(self, layer_id, topk_indices) -> None:
        return None

    cache = cap.device_cache
    out = {}
    for v, attrs in variants.items():
        if v == "upstream":
            continue
        sglang_wrapper = attrs[(BaseDeviceCache, "capture")]
        cells = dict(zip(sglang_wrapper.__code__.co_freevars, sglang_wrapper.__closure__, strict=True))
        fn = cells["hook"].cell_contents
        wrapped = _wrap_fn(noop, fn, HookType.AROUND)
        timers.configure(v != "timers_off")
        wrapped(cache, 0, topk)  # the routed layers are known after the first forward: steady state
        out[v] = min(_block_ns(lambda w=wrapped: w(cache, 1, topk), 20000) for _ in range(rounds)) - min(
            _block_ns(lambda: noop(cache, 1, topk), 20000) for _ in range(rounds)
        )
    return out


def child(repeats: int, quick: bool, before: str | None, device: str = "cpu") -> list[dict[str, Any]]:
    """Every shape, every variant, in this (fresh) process."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import torch
    from sglang_env import cpu_workarounds

    cpu_workarounds()
    torch.set_num_threads(1)
    if device == "cuda":
        from sglang.srt.mem_cache.pool_host import common as host_common

        # The host cache unregistered, as on the CPU: no timed part touches it (overlap mode's forward end
        # hands back device clones), and registering the benchmark's large one failed on the lent GPU (712).
        host_common.ALLOC_MEMORY_FUNCS["cuda"] = host_common.ALLOC_MEMORY_FUNCS["cpu"]
        _SYNC[0] = torch.cuda.synchronize
    variants = _variants(before)
    rows = []
    for layers in LAYERS[-1:] if quick else LAYERS:
        for dp, kind, tokens in SHAPES[::3] if quick else SHAPES:
            row = {"layers": layers, "dp": dp, "kind": kind, "tokens": tokens}
            rows.append(row | one_shape(variants, layers, dp, kind, tokens, repeats, device))
            print(f"{row}", file=sys.stderr, flush=True)
    return rows


def _best_ns(fn, repeats: int, number: int) -> float:
    """Least over `repeats` blocks: on a shared machine other jobs only ever add time."""
    return min(_block_ns(fn, number) for _ in range(repeats))


def timer_cost_ns(repeats: int) -> dict[str, float]:
    """What one timed call costs: a `timed` AROUND hook, on and switched off, against the bare call."""
    from engine_ext.sglang import timers

    def original() -> None:
        return None

    def bare(orig) -> None:
        return orig()

    wrapped = timers.timed(timers.FORWARD_END)(bare)
    timers.configure(True)

    n = 200_000
    base = _best_ns(lambda: bare(original), repeats, n)
    out = {"timed_around_ns": _best_ns(lambda: wrapped(original), repeats, n) - base}
    timers.configure(False)
    out["timed_around_off_ns"] = _best_ns(lambda: wrapped(original), repeats, n) - base
    timers.configure(True)
    return out


def _added(row: dict[str, Any], variant: str) -> dict[str, float]:
    """What `variant` adds to upstream at one shape: per forward (µs), per layer (ns), and its parts."""
    up, on = row["upstream"], row[variant]
    extent, end = on["extent_ns"] - up["extent_ns"], on["end_ns"] - up["end_ns"]
    layers = on["layers_ns"] - up["layers_ns"]
    return {
        "forward_us": (extent + layers + end) / 1e3,
        "per_layer_ns": layers / row["layers"],
        "extent_ns": extent,
        "end_ns": end,
    }


def render(results: dict[str, Any]) -> str:
    """The microbenchmark table: upstream's capture path per forward, and what the plugin adds to it."""
    variants = [v for v in ("timers_on", "timers_off", "before") if v in results["rows"][0]]
    head = ["layers", "DP", "forward", "rows per layer", "upstream capture path µs"]
    head += [f"added µs/forward ({v})" for v in variants] + [
        "of which per layer ns (timers_on)",
        "extent ns",
        "forward_end ns",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        up = row["upstream"]
        base = (up["extent_ns"] + up["layers_ns"] + up["end_ns"]) / 1e3
        added = {v: _added(row, v) for v in variants}
        on = added["timers_on"]
        cells = [row["layers"], row["dp"], f"{row['kind']} {row['tokens']}", row["tokens"] * row["dp"], f"{base:.1f}"]
        cells += [f"{added[v]['forward_us']:+.1f}" for v in variants]
        cells += [f"{on['per_layer_ns']:+.0f}", f"{on['extent_ns']:+.0f}", f"{on['end_ns']:+.0f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    compiled = [row for row in results["rows"] if "compiled_ns" in row]
    if compiled:
        lines += ["", "| layers | forward | compiled upstream µs | compiled with the plugin µs | added µs |"]
        lines.append("|---|---|---|---|---|")
        for row in compiled:
            ns = row["compiled_ns"]
            up, on = ns["upstream"] / 1e3, ns["timers_on"] / 1e3
            lines.append(f"| {row['layers']} | {row['kind']} {row['tokens']} | {up:.1f} | {on:.1f} | {on - up:+.1f} |")
    cost = results["timer_cost"]
    lines += [
        "",
        f"Timers' own cost: a `timed` AROUND hook {cost['timed_around_ns']:.0f} ns per call, switched off "
        f"{cost['timed_around_off_ns']:.0f} ns (one attribute test and a frame).",
    ]
    return "\n".join(lines)


def run_child(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hooks", "--child", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **os.environ},
        timeout=1800,  # the compiled variant compiles 2 graphs per decode shape
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child exited {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="where the capturer and its tensors live: cpu or cuda")
    ap.add_argument("--before", type=Path, help="also time the plugin tree at this path (e.g. a `git archive`)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--render", type=Path, help="no run: print the table of a saved results file")
    args = ap.parse_args()
    before = str(args.before.resolve()) if args.before else None
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return
    if args.child:
        print(json.dumps(child(args.rounds, args.quick, before, args.device)))
        return
    flags = [
        "--rounds",
        str(args.rounds),
        *(["--quick"] if args.quick else []),
        *(["--device", args.device] if args.device != "cpu" else []),
        *(["--before", before] if before else []),
    ]
    results: dict[str, Any] = {"timer_cost": timer_cost_ns(7), "environment": environment(), "rows": run_child(*flags)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(render(results))


if __name__ == "__main__":
    main()
