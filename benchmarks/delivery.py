"""Delivery per request, side by side: SGLang's inline path and the sidecar, from the engine's int32 rows
to a numpy array in the trainer.

Inline: the inline server (its own process) base64-encodes with SGLang's detokenizer function, answers with
SGLang's orjson response; the trainer parses the body and runs `extract_routed_experts_from_meta_info` +
reshape. Ours: compaction to the spool dtype, `Spool.writer` append + finalize, then the sidecar (its own
process) serves it and `RoutedExpertsClient.get` returns the array. Both clocks start at the same int32
rows and stop at an array the trainer can index; both use one kept-alive loopback connection.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import torch

from benchmarks.concurrency import LeanClient
from benchmarks.inline_path import trainer_decode
from benchmarks.shapes import ModelShape
from benchmarks.stats import summary
from service.client import RoutedExpertsClient
from service.spool import Spool


def case_name(shape: ModelShape, tokens: int) -> str:
    return f"{shape.name}-{tokens}"


def write_inline_payloads(directory: Path, cases: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Hand the inline server its finished requests: int32 host-layout rows and the prompt length."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (rows, prompt_len) in cases.items():
        np.save(directory / f"{name}.npy", rows.numpy())
        (directory / f"{name}.len").write_text(str(prompt_len))


def response_bytes(response: httpx.Response) -> int:
    """Bytes of the HTTP/1.1 response as sent: status line, headers, blank line, body."""
    head = len(f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n")
    head += sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 2
    return head + len(response.content)


def inline_once(http: httpx.Client, name: str, shape: ModelShape) -> tuple[float, float, np.ndarray, int]:
    """One request: (end-to-end s, server-side s, decoded array, response bytes)."""
    t0 = time.perf_counter()
    resp = http.post("/generate", content=orjson.dumps({"rid": name}))
    resp.raise_for_status()
    array = trainer_decode(resp.content, shape.num_hidden_layers, shape.topk)
    elapsed = time.perf_counter() - t0
    return elapsed, float(resp.headers["x-bench-server-s"]), array, response_bytes(resp)


def ours_once(
    spool: Spool, client: RoutedExpertsClient, rid: str, shape: ModelShape, rows: torch.Tensor, prompt_len: int
) -> tuple[float, float, np.ndarray]:
    """One request: (end-to-end s, engine-side write s, fetched array)."""
    from engine_ext.core.records import compact

    t0 = time.perf_counter()
    data = compact(rows.numpy()[:, shape.first_moe_layer :, :], shape.dtype)
    writer = spool.writer(
        rid,
        num_experts=shape.num_experts,
        topk=shape.topk,
        layers=shape.moe_layers,
        start=0,
        prompt_len=prompt_len,
        dtype=shape.dtype,
    )
    writer.append(data, publish=False)
    writer.finalize()
    t1 = time.perf_counter()
    array = client.get(rid, wait=30).array
    return time.perf_counter() - t0, t1 - t0, array


def check_same(shape: ModelShape, inline: np.ndarray, ours: np.ndarray, compact: np.ndarray) -> None:
    """Both paths deliver the engine's rows: inline as int32 with dense zeros, ours compact."""
    if not np.array_equal(inline[:, shape.first_moe_layer :, :], compact.astype(np.int32)):
        raise AssertionError(f"{shape.name}: inline rows differ from the engine's")
    if shape.first_moe_layer and np.any(inline[:, : shape.first_moe_layer, :]):
        raise AssertionError(f"{shape.name}: inline dense layers are not zero")
    if ours.dtype != np.dtype(shape.dtype) or not np.array_equal(ours, compact):
        raise AssertionError(f"{shape.name}: sidecar rows differ from the engine's")


def measure_case(
    inline_url: str,
    sidecar_url: str,
    spool: Spool,
    shape: ModelShape,
    tokens: int,
    compact: np.ndarray,
    host_rows: torch.Tensor,
    reps: int,
) -> dict:
    """Interleave inline and ours `reps` times (after one warm-up each) so load drifts hit both alike."""
    name = case_name(shape, tokens)
    prompt_len = tokens // 2
    inline_t, server_t, ours_t, write_t, lean_t = [], [], [], [], []
    lean = LeanClient(sidecar_url)
    with (
        httpx.Client(base_url=inline_url, timeout=120) as http,
        RoutedExpertsClient(sidecar_url, timeout=120, local_reads=False) as rc,
    ):
        for rep in range(reps + 1):
            e2e, srv, inline_array, inline_bytes = inline_once(http, name, shape)
            rid = f"{name}-r{rep}"
            ours_e2e, ours_write, ours_array = ours_once(spool, rc, rid, shape, host_rows, prompt_len)
            t0 = time.perf_counter()
            lean_array = lean.get(rid)
            lean_fetch = time.perf_counter() - t0
            if rep == 0:
                check_same(shape, inline_array, ours_array, compact)
                check_same(shape, inline_array, lean_array, compact)
                wire = httpx.get(f"{sidecar_url}/routed_experts/{rid}", params={"format": "npy"}, timeout=120)
                wire.raise_for_status()
                ours_bytes = response_bytes(wire)
            else:
                inline_t.append(e2e)
                server_t.append(srv)
                ours_t.append(ours_e2e)
                write_t.append(ours_write)
                lean_t.append(ours_write + lean_fetch)
            del inline_array, ours_array, lean_array
            rc.ack(rid)
    lean.close()
    inline_s, ours_s = summary(inline_t), summary(ours_t)
    return {
        "model": shape.name,
        "tokens": tokens,
        "rows": int(compact.shape[0]),
        "inline_bytes": inline_bytes,
        "ours_bytes": ours_bytes,
        "bytes_ratio": ours_bytes / inline_bytes,
        "inline_s": inline_s,
        "inline_server_s": summary(server_t),
        "ours_s": ours_s,
        "ours_write_s": summary(write_t),
        "speedup": inline_s["p50"] / ours_s["p50"],
        "ours_lean_s": summary(lean_t),
        "speedup_lean": inline_s["p50"] / summary(lean_t)["p50"],
        "decoded_equal": True,
    }
