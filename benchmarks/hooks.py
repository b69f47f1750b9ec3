"""`make bench-hooks`: what each capture hook adds to SGLang's own code path, on SGLang 0.5.23's real classes.

    .venv/bin/python -m benchmarks.hooks            # ~2 minutes; benchmarks/out/hooks.json and a table
    .venv/bin/python -m benchmarks.hooks --quick    # fewer shapes and repeats

Each variant runs in its own interpreter, because `HookRegistry` patches SGLang's classes in place:
`upstream` (no plugin hook: only a `_forward_raw` stand-in through the same registry), `timers_on` (the
plugin's capture hooks, `R3_HOOK_TIMERS=1`, the default) and `timers_off`. Per forward, on one DP rank:

- `extent`: `ModelRunner._forward_raw` (a model body that does nothing) through the registry: what
  `_record_forward_extent` adds per forward;
- `layers`: the real capture site `topk.capture_routed_experts_if_allowed` → `RoutedExpertsCapturer.capture`
  → `BaseDeviceCache.capture` for every layer: what `_checked_device_capture` adds per layer;
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.run import environment

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "hooks.json"
TINY = ROOT / "tests" / "sglang_cpu" / "tiny_qwen3moe" / "config.json"
VARIANTS = ("upstream", "timers_on", "timers_off")
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


def _best_ns(fn, repeats: int, number: int) -> float:
    """Median over `repeats` of the mean time of `number` calls (ns per call)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            fn()
        times.append((time.perf_counter_ns() - t0) / number)
    return statistics.median(times)


def child(variant: str, repeats: int, quick: bool) -> list[dict[str, Any]]:
    """One variant, every shape, in this (fresh) process."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_env import cpu_workarounds

    from engine_ext import hooks
    from engine_ext.settings import EngineSettings

    cpu_workarounds()
    HookRegistry.reset()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _model_body, HookType.REPLACE
    )
    if variant != "upstream":
        hooks.install_capture_hooks(EngineSettings(hook_timers=variant == "timers_on"))
    HookRegistry.apply_hooks()
    rows = []
    for layers in LAYERS[-1:] if quick else LAYERS:
        for dp, kind, tokens in SHAPES[::3] if quick else SHAPES:
            rows.append({"layers": layers, "dp": dp, "kind": kind, "tokens": tokens})
            rows[-1] |= one_shape(variant, layers, dp, kind, tokens, repeats)
    return rows


_SHAPE: dict[str, Any] = {}


def _model_body(runner, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    """`_forward_raw` without a model: what `_prepare_eager_forward_batch` leaves for the capturer under DP."""
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    dp, tokens = _SHAPE["dp"], _SHAPE["tokens"]
    if dp > 1:  # prepare_mlp_sync_batch: a new padded list each forward
        forward_batch.global_num_tokens_padded_cpu = [tokens] * dp
    return ModelRunnerOutput(logits_output=None, can_run_graph=False)


def one_shape(variant: str, layers: int, dp: int, kind: str, tokens: int, repeats: int) -> dict[str, Any]:
    """One shape: a fresh published config, capturer and batch."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args

    from engine_ext import capturer, timers

    torch.set_num_threads(1)
    _SHAPE.update(dp=dp, tokens=tokens)
    capturer.ROUTED_LAYERS = capturer.RoutedLayers()  # this shape's model
    timers.TIMERS.reset()
    gathered = tokens * dp  # DP attention: every rank's MoE routes the gathered batch
    server = {"enable_return_routed_experts": True, "chunked_prefill_size": 8192, "max_running_requests": 512}
    if dp > 1:
        server |= {"tp_size": dp, "attn_dp_size": dp}
    publish_args(world_rank=min(1, dp - 1), **server)

    with tempfile.TemporaryDirectory() as tmp:
        model_config = ModelConfig(str(_model_dir(Path(tmp), layers)))
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model, model_config=model_config, num_tokens=8192, max_running_requests=512, device="cpu"
    )
    set_global_experts_capturer(cap)
    runner = ModelRunner.__new__(ModelRunner)
    runner.decode_cuda_graph_runner = None
    mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=tokens if kind == "decode" else 1,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.ones(1, dtype=torch.int64),
        out_cache_loc=torch.arange(tokens, dtype=torch.int64),
        seq_lens_sum=tokens,
    )
    fb.global_num_tokens_cpu = [tokens] * dp if dp > 1 else None
    topk = torch.randint(0, 128, (gathered, 8), dtype=torch.int32)
    config = TopKConfig(top_k=8)

    def extent() -> None:
        runner._forward_raw(fb, None)

    def body() -> None:
        for layer in range(layers):
            capture_routed_experts_if_allowed(config, layer, topk)

    def end() -> None:
        cap.on_forward_end(forward_batch=fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)

    extent(), body(), end()  # the first forward: routed layers noted, occupancy started
    number = 200 if gathered <= 512 else 10
    out: dict[str, Any] = {
        "extent_ns": _best_ns(extent, repeats, 2000),
        "layers_ns": _best_ns(body, repeats, number),
        "end_ns": _best_ns(end, repeats, number),
    }
    if variant == "timers_on":
        out["hooks"] = timers.TIMERS.snapshot()
    set_global_experts_capturer(None)
    return out


def timer_cost_ns(repeats: int) -> dict[str, float]:
    """What one timed call costs: a `timed` AROUND hook and an inline `book`, against the bare calls."""
    from engine_ext import timers

    def original() -> None:
        return None

    def bare(orig) -> None:
        return orig()

    wrapped = timers.timed(timers.FORWARD_END)(bare)
    timers.configure(True)

    def inline() -> None:
        t0 = timers.clock() if timers.TIMERS.on else 0
        if t0:
            timers.TIMERS.book(timers.DEVICE_CAPTURE, t0)

    n = 200_000
    base = _best_ns(lambda: bare(original), repeats, n)
    out = {
        "timed_around_ns": _best_ns(lambda: wrapped(original), repeats, n) - base,
        "inline_book_ns": _best_ns(inline, repeats, n) - _best_ns(lambda: None, repeats, n),
    }
    timers.configure(False)
    out["timed_around_off_ns"] = _best_ns(lambda: wrapped(original), repeats, n) - base
    timers.configure(True)
    return out


def run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hooks", "--child", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **os.environ},
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "REPEATS"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child:
        variant, repeats = args.child
        print(json.dumps(child(variant, int(repeats), args.quick)))
        return
    repeats = 3 if args.quick else 7
    results: dict[str, Any] = {"timer_cost": timer_cost_ns(repeats), "environment": environment(), "rows": []}
    quick = ["--quick"] if args.quick else []
    by_variant = {v: run_child(v, str(repeats), *quick) for v in VARIANTS}
    for i, shape in enumerate(by_variant["upstream"]):
        row = {k: shape[k] for k in ("layers", "dp", "kind", "tokens")} | {v: by_variant[v][i] for v in VARIANTS}
        results["rows"].append(row)
        up, on = row["upstream"], row["timers_on"]
        per_layer = (on["layers_ns"] - up["layers_ns"]) / row["layers"]
        print(
            f"L={row['layers']} dp={row['dp']} {row['kind']} {row['tokens']}: added extent "
            f"{on['extent_ns'] - up['extent_ns']:.0f} ns, per layer {per_layer:.0f} ns, "
            f"end {on['end_ns'] - up['end_ns']:.0f} ns",
            file=sys.stderr,
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["timer_cost"]))


if __name__ == "__main__":
    main()
