"""Trainer time from a finished response to the framework's own routed-experts tensor: inline vs the sidecar.

Inline: the response carries SGLang's payload (built by SGLang 0.5.23's own encoder,
`DetokenizerManager._b64_encode_per_request`) and the framework decodes it as its code does:
- verl 0.9.1: base64 → int32 `(rows, num_hidden_layers, topk)` (async_sglang_server.py:697), the server's
  `TokenOutput.routed_experts`; `verl + as_dict` adds `as_dict`'s `torch.tensor(..., dtype=torch.int16)`
  (agent_loop.py:131), which both paths then pay;
- AReaL 1.0.4: its own `SGLangBackend.parse_generation_response` (run, from `.venv-trainers`);
- slime / miles: base64 → int32 `(rows, num_layers, topk)` (`decode_int32_meta_array` + reshape).
Ours: the response carries a pointer; `RoutedExpertsRef.from_response(resp)[0].fetch()` (blocking) or
`await ....afetch()` (asyncio, one event loop) reads the rows (uint8; uint16 for Kimi-K2) straight from the
spool, since the sidecar (its own process) is on this node (service.client.local.reads, the default), and
`ours HTTP` fetches them from the sidecar on loopback (`R3_LOCAL_READS=0`, what a trainer on another node
gets); `service.client.trainers` builds the same tensor (AReaL's `parse_generation_response`
still runs, on a response without the payload). Both paths start from the response as a dict in hand; the
`+ JSON` column adds parsing the inline response body, which every trainer that talks HTTP to SGLang pays
(AReaL, slime, miles; verl in-process does not). Every case checks that all paths give equal tensors. The
frameworks decode inline payloads synchronously in their async code, so the inline column stands for both.

    .venv/bin/python -m benchmarks.trainer_ingest [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import pybase64
import torch
from sglang.srt.managers.detokenizer_manager import DetokenizerManager

from benchmarks.servers import serve
from benchmarks.shapes import SHAPES, inline_layout, routing
from benchmarks.stats import summary
from service.client import RoutedExperts, trainers
from service.client.refs import RoutedExpertsRef, SidecarPool, aclose_clients, close_clients
from service.spool import Spool

TRAINERS = Path(__file__).resolve().parent.parent / ".venv-trainers"
OUTPUT_TOKENS = 1024


def response(rid: str, payload: str | None, rows: int) -> dict:
    """SGLang's `/generate` result as AReaL asks for it (`return_logprob`), with or without the inline payload."""
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": OUTPUT_TOKENS},
        "prompt_tokens": rows + 1 - OUTPUT_TOKENS,
        "completion_tokens": OUTPUT_TOKENS,
        "output_token_logprobs": [[-0.5, 7, None]] * OUTPUT_TOKENS,
    }
    if payload is not None:
        meta["routed_experts"] = payload
    return {"text": "", "output_ids": [7] * OUTPUT_TOKENS, "meta_info": meta}


def frameworks(num_hidden_layers: int, topk: int):
    """name → (inline decode of a response dict, the adapter from the response and its fetched rows)."""
    sys.path.append(str(TRAINERS))
    from areal.engine.sglang_remote import SGLangBackend

    backend = SGLangBackend()

    def b64_int32(resp: dict) -> np.ndarray:
        return np.frombuffer(pybase64.b64decode(resp["meta_info"]["routed_experts"]), dtype=np.int32)

    def areal_ours(resp: dict, r: RoutedExperts) -> np.ndarray:
        parsed = backend.parse_generation_response(resp)
        parsed.routed_experts = trainers.areal(r, num_hidden_layers)
        return parsed.routed_experts

    return {
        "verl": (
            lambda resp: b64_int32(resp).reshape(-1, num_hidden_layers, topk),
            lambda resp, r: trainers.verl(r, num_hidden_layers),
        ),
        "verl + as_dict": (
            lambda resp: torch.tensor(b64_int32(resp).reshape(-1, num_hidden_layers, topk), dtype=torch.int16),
            lambda resp, r: torch.tensor(trainers.verl(r, num_hidden_layers), dtype=torch.int16),
        ),
        "AReaL": (lambda resp: backend.parse_generation_response(resp).routed_experts, areal_ours),
        "slime/miles": (
            lambda resp: torch.frombuffer(
                bytearray(pybase64.b64decode(resp["meta_info"]["routed_experts"])), dtype=torch.int32
            ).reshape(-1, num_hidden_layers, topk),
            lambda resp, r: torch.from_numpy(trainers.slime(r, num_hidden_layers)),
        ),
    }


def equal(a, b) -> bool:
    a, b = (x.numpy() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def write_record(spool: Spool, rid: str, shape, compact: np.ndarray) -> None:
    rows = compact.shape[0]
    writer = spool.writer(
        rid,
        num_experts=shape.num_experts,
        topk=shape.topk,
        layers=shape.moe_layers,
        prompt_len=rows + 1 - OUTPUT_TOKENS,
        num_hidden_layers=shape.num_hidden_layers,
    )
    writer.append(compact)
    writer.finalize()


def measure(
    inline, adapter, inline_resp: dict, pointer_resp: dict, reps: int, loop, http: SidecarPool
) -> dict[str, float]:
    """Median ms of each path, interleaved repetition by repetition (the machine's load hits all alike), in an
    order that turns each repetition (glibc reuses or maps afresh what the path before freed)."""
    body = orjson.dumps(inline_resp)

    def ours(resp: dict):
        return adapter(resp, RoutedExpertsRef.from_response(resp)[0].fetch())

    def ours_http(resp: dict):
        return adapter(resp, RoutedExpertsRef.from_response(resp)[0].fetch(pool=http))

    async def aours(resp: dict):
        return adapter(resp, await RoutedExpertsRef.from_response(resp)[0].afetch())

    expected = inline(inline_resp)
    assert RoutedExpertsRef.from_response(pointer_resp)[0].fetch().source == "spool"
    assert RoutedExpertsRef.from_response(pointer_resp)[0].fetch(pool=http).source == "http"
    got_all = (ours(pointer_resp), loop.run_until_complete(aours(pointer_resp)), ours_http(pointer_resp))
    for got in (inline(orjson.loads(body)), *got_all):
        assert equal(expected, got)
    paths = {
        "inline_ms": lambda: inline(inline_resp),
        "inline_json_ms": lambda: inline(orjson.loads(body)),
        "ours_ms": lambda: ours(pointer_resp),
        "async_ms": lambda: loop.run_until_complete(aours(pointer_resp)),
        "http_ms": lambda: ours_http(pointer_resp),
    }
    times: dict[str, list[float]] = {key: [] for key in paths}
    order = list(paths.items())
    for rep in range(reps):  # the order turns each repetition: what a path frees shapes the next one's allocations
        for key, call in order[rep % len(order) :] + order[: rep % len(order)]:
            t0 = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t0)
    return {key: summary(values)["p50"] * 1e3 for key, values in times.items()}


HEADER = (
    "| framework | model | tokens | inline ms | inline + JSON ms | ours ms | ours async ms | speedup "
    "| async speedup | async ÷ blocking | ours HTTP ms | HTTP speedup | HTTP speedup vs + JSON | reps |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(row: dict) -> str:
    i, j, o, a, h = row["inline_ms"], row["inline_json_ms"], row["ours_ms"], row["async_ms"], row["http_ms"]
    return (
        f"| {row['framework']} | {row['model']} | {row['tokens']} | {i:.2f} | {j:.1f} | {o:.2f} | {a:.2f} "
        f"| {i / o:.1f}× | {i / a:.1f}× | {a / o:.2f} | {h:.1f} | {i / h:.1f}× | {j / h:.1f}× | {row['reps']} |"
    )


def run(models: list[str], token_counts: list[int], reps: dict[int, int]) -> list[dict]:
    out = []
    loop = asyncio.new_event_loop()
    http = SidecarPool(local_reads=False)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root, serve("sidecar", Path(root)) as server:
        spool = Spool(Path(root))
        for name in models:
            shape = SHAPES[name]
            for tokens in token_counts:
                rows, rid = tokens - 1, f"{name}-{tokens}"
                compact = routing(shape, rows, seed=tokens)
                write_record(spool, rid, shape, compact)
                (payload,) = DetokenizerManager._b64_encode_per_request([inline_layout(shape, compact)])
                inline_resp, pointer_resp = response(rid, payload, rows), response(rid, None, rows)
                pointer_resp["meta_info"]["routed_experts_url"] = f"{server.url}/routed_experts/{rid}"
                time.sleep(0.3)  # the sidecar indexes the new record
                for framework, (inline, adapter) in frameworks(shape.num_hidden_layers, shape.topk).items():
                    row = {"framework": framework, "model": name, "tokens": tokens, "reps": reps[tokens]}
                    row |= measure(inline, adapter, inline_resp, pointer_resp, reps[tokens], loop, http)
                    out.append(row)
                    print(table_row(row), flush=True)
    loop.run_until_complete(aclose_clients())
    close_clients()
    http.close()
    loop.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small shape, few repetitions (harness check)")
    ap.add_argument("--models", nargs="*", default=["Qwen3-30B-A3B", "DeepSeek-V3", "Kimi-K2"])
    args = ap.parse_args()
    if not (TRAINERS / ".stamp").exists():
        raise SystemExit(f"{TRAINERS} missing: run `make trainers` first (AReaL's own parser is timed)")
    print(HEADER)
    if args.quick:
        run(["Qwen3-30B-A3B"], [2048], {2048: 3})
    else:
        run(args.models, [8192, 32768], {8192: 20, 32768: 8})


if __name__ == "__main__":
    main()
