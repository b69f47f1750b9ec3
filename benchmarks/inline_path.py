"""SGLang 0.5.23's inline delivery, built from its own functions.

Server side: the detokenizer's `_b64_encode_per_request` (a staticmethod: called on the class, no manager
needed), the tokenizer manager's `meta_info` fields, and the HTTP server's `orjson_response`. Trainer side:
`extract_routed_experts_from_meta_info` and the reshape every trainer applies (verl, slime, AReaL).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import orjson
import torch
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info
from sglang.srt.utils.json_response import orjson_response
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def generate_response(rid: str, rows: torch.Tensor, prompt_len: int) -> dict:
    """The `/generate` result SGLang returns for a finished request with `return_routed_experts=True`.

    `text` and `output_ids` are left empty: both paths would carry them, so they do not change the gap.
    """
    (encoded,) = DetokenizerManager._b64_encode_per_request([rows])
    completion = rows.shape[0] + 1 - prompt_len
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": completion},
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.0,
            "routed_experts": encoded,
        },
    }


def trainer_decode(body: bytes, num_hidden_layers: int, topk: int) -> np.ndarray:
    """What a trainer does with the response body: parse, base64-decode, reshape (verl's code path)."""
    data = orjson.loads(body)
    return extract_routed_experts_from_meta_info(data).reshape(-1, num_hidden_layers, topk)


def load_payloads(directory: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """`<rid>.npy` int32 host-layout rows written by the harness, with the prompt length in `<rid>.len`."""
    out = {}
    for path in sorted(directory.glob("*.npy")):
        prompt_len = int(path.with_suffix(".len").read_text())
        out[path.stem] = (torch.from_numpy(np.load(path)), prompt_len)
    return out


def create_inline_app(payload_dir: Path) -> Starlette:
    """A loopback stand-in for SGLang's HTTP server holding finished requests' rows in memory.

    `POST /generate {"rid": ...}` encodes and returns that request as SGLang does; the server-side seconds
    (encode + JSON) go back in `X-Bench-Server-S` so the report can split the time.
    """
    payloads = load_payloads(payload_dir)

    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        rid = body.get("rid")
        if rid not in payloads:
            return Response(orjson.dumps({"error": "not_found", "detail": f"no payload {rid!r}"}), status_code=404)
        t0 = time.perf_counter()
        rows, prompt_len = payloads[rid]
        response = orjson_response(generate_response(rid, rows, prompt_len))
        response.headers["X-Bench-Server-S"] = f"{time.perf_counter() - t0:.6f}"
        return response

    async def health(_: Request) -> Response:
        return Response(b"ok")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/healthz", health)])
