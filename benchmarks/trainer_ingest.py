"""Trainer time from a finished response to the framework's own routed-experts tensor: inline vs the sidecar.

Inline: the response carries SGLang's payload (built by SGLang 0.5.23's own encoder,
`DetokenizerManager._b64_encode_per_request`) and the framework decodes it as its code does:
- verl 0.9.1: base64 → int32 `(rows, num_hidden_layers, topk)` (async_sglang_server.py:697), the server's
  `TokenOutput.routed_experts`; `verl + as_dict` adds `as_dict`'s `torch.tensor(..., dtype=torch.int16)`
  (agent_loop.py:131), which both paths then pay;
- AReaL 1.0.4: its own `SGLangBackend.parse_generation_response` (run, from `.venv-trainers`);
- slime / miles: base64 → int32 `(rows, num_layers, topk)` (`decode_int32_meta_array` + reshape).
Ours: the response carries a pointer; `RoutedExpertsClient.get` fetches the uint8 rows from a sidecar in its
own process on loopback, and `service.trainers` builds the same tensor (AReaL's `parse_generation_response`
still runs, on a response without the payload). Both paths start from the response as a dict in hand; the
`+ JSON` column adds parsing the inline response body, which every trainer that talks HTTP to SGLang pays
(AReaL, slime, miles; verl in-process does not). Every case checks that both paths give equal tensors. Blocking
only: the async client of Contract 4 has not landed on this branch.

    .venv/bin/python -m benchmarks.trainer_ingest [--quick]
"""

from __future__ import annotations

import argparse
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
from service import trainers
from service.client import RoutedExpertsClient
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


def frameworks(num_hidden_layers: int, topk: int, client: RoutedExpertsClient):
    """name → (inline decode of a response dict, ours from a pointer response): each returns the tensor."""
    sys.path.append(str(TRAINERS))
    from areal.engine.sglang_remote import SGLangBackend

    backend = SGLangBackend()

    def b64_int32(resp: dict) -> np.ndarray:
        return np.frombuffer(pybase64.b64decode(resp["meta_info"]["routed_experts"]), dtype=np.int32)

    def fetch(resp: dict):
        return client.get(resp["meta_info"]["id"])

    def areal_ours(resp: dict) -> np.ndarray:
        parsed = backend.parse_generation_response(resp)
        parsed.routed_experts = trainers.areal(fetch(resp), num_hidden_layers)
        return parsed.routed_experts

    return {
        "verl": (
            lambda resp: b64_int32(resp).reshape(-1, num_hidden_layers, topk),
            lambda resp: trainers.verl(fetch(resp), num_hidden_layers),
        ),
        "verl + as_dict": (
            lambda resp: torch.tensor(b64_int32(resp).reshape(-1, num_hidden_layers, topk), dtype=torch.int16),
            lambda resp: torch.tensor(trainers.verl(fetch(resp), num_hidden_layers), dtype=torch.int16),
        ),
        "AReaL": (lambda resp: backend.parse_generation_response(resp).routed_experts, areal_ours),
        "slime/miles": (
            lambda resp: torch.frombuffer(
                bytearray(pybase64.b64decode(resp["meta_info"]["routed_experts"])), dtype=torch.int32
            ).reshape(-1, num_hidden_layers, topk),
            lambda resp: torch.from_numpy(trainers.slime(fetch(resp), num_hidden_layers)),
        ),
    }


def equal(a, b) -> bool:
    a, b = (x.numpy() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def run(models: list[str], token_counts: list[int], reps: dict[int, int]) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root, serve("sidecar", Path(root)) as server:
        spool = Spool(Path(root))
        with RoutedExpertsClient(server.url) as client:
            for name in models:
                shape = SHAPES[name]
                decoders = frameworks(shape.num_hidden_layers, shape.topk, client)
                for tokens in token_counts:
                    rows = tokens - 1
                    compact = routing(shape, rows, seed=tokens)
                    rid = f"{name}-{tokens}"
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
                    (payload,) = DetokenizerManager._b64_encode_per_request([inline_layout(shape, compact)])
                    inline_resp, pointer_resp = response(rid, payload, rows), response(rid, None, rows)
                    body = orjson.dumps(inline_resp)
                    time.sleep(0.3)  # the sidecar indexes the new record
                    for framework, (inline, ours) in decoders.items():
                        assert equal(inline(inline_resp), ours(pointer_resp)), (framework, name, tokens)
                        t_inline, t_json, t_ours = [], [], []
                        for _ in range(reps[tokens]):  # interleaved: the machine's load hits both alike
                            t0 = time.perf_counter()
                            inline(inline_resp)
                            t1 = time.perf_counter()
                            inline(orjson.loads(body))
                            t2 = time.perf_counter()
                            ours(pointer_resp)
                            t3 = time.perf_counter()
                            t_inline.append(t1 - t0)
                            t_json.append(t2 - t1)
                            t_ours.append(t3 - t2)
                        row = {
                            "framework": framework,
                            "model": name,
                            "tokens": tokens,
                            "inline_ms": summary(t_inline)["p50"] * 1e3,
                            "inline_json_ms": summary(t_json)["p50"] * 1e3,
                            "ours_ms": summary(t_ours)["p50"] * 1e3,
                            "reps": reps[tokens],
                        }
                        out.append(row)
                        print(
                            f"| {framework} | {name} | {tokens} | {row['inline_ms']:.1f} | {row['inline_json_ms']:.1f} "
                            f"| {row['ours_ms']:.1f} | {row['inline_ms'] / row['ours_ms']:.1f}× "
                            f"| {row['inline_json_ms'] / row['ours_ms']:.1f}× | {row['reps']} |",
                            flush=True,
                        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small shape, few repetitions (harness check)")
    args = ap.parse_args()
    if not (TRAINERS / ".stamp").exists():
        raise SystemExit(f"{TRAINERS} missing: run `make trainers` first (AReaL's own parser is timed)")
    print(
        "| framework | model | tokens | inline ms | inline + JSON ms | ours ms | speedup | speedup vs + JSON | reps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    if args.quick:
        run(["Qwen3-30B-A3B"], [2048], {2048: 3})
    else:
        run(["Qwen3-30B-A3B", "DeepSeek-V3"], [8192, 32768], {8192: 20, 32768: 8})


if __name__ == "__main__":
    main()
