"""Where the time goes, for the targets a run can miss: measured in the same run as the tables.

- `client_stacks`: one record fetched from the same sidecar by the project's client, by plain httpx, by the
  standard library's `http.client` (`readinto` a Content-Length-sized buffer) and by a raw socket
  (`recv_into`, no HTTP parsing): the gaps are the cost of each layer of the client's HTTP stack.
- `compaction`: the plugin's finish-time compaction (`engine_ext.sglang.collect.to_spool_rows` over the gathered
  int32 rows) against upstream's gather alone and against one fused numpy gather of the routed layers.
- `live_compaction`: one decode step's rows compacted per request (`to_spool_rows` on each request's row,
  as `LiveRows.feed` does) against one cast of the whole step and a view per request.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import quote, urlsplit

import httpx
import numpy as np
import torch

from benchmarks.concurrency import LeanClient
from benchmarks.shapes import ModelShape
from benchmarks.stats import summary
from service.client import RoutedExpertsClient


def _cpu_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return float(np.median(times)) * 1e3


def _wall(fn, reps: int) -> dict:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summary(times)


def client_stacks(url: str, rid: str, nbytes: int, reps: int) -> dict:
    """Seconds to fetch one record through each client stack, over kept-alive connections (raw: a new one)."""
    parts = urlsplit(url)
    path = f"/routed_experts/{quote(rid, safe='')}?format=npy"
    request = f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode()
    sink = bytearray(nbytes + 65536)

    def raw() -> None:
        with socket.create_connection((parts.hostname, parts.port)) as sock:
            sock.sendall(request)
            view, got = memoryview(sink), 0
            while n := sock.recv_into(view[got : got + (1 << 20)]):
                got += n

    with RoutedExpertsClient(url, local_reads=False) as rc, httpx.Client(base_url=url) as hx:
        lean = LeanClient(url)
        out = {
            "RoutedExpertsClient.get": _wall(lambda: rc.get(rid), reps),
            "httpx.Client.get().content": _wall(lambda: hx.get(path).content, reps),
            "http.client readinto": _wall(lambda: lean.get(rid), reps),
            "raw socket recv_into": _wall(raw, reps),
        }
        lean.close()
    return {"bytes": nbytes, "stacks": out}


def compaction(shape: ModelShape, host_tokens: int, lengths: tuple[int, ...], reps: int) -> list[dict]:
    """Thread-CPU ms per finished request: gather, the plugin's compaction, and a fused numpy gather."""
    from engine_ext.sglang.gather import gather_slots, to_spool_rows

    gen = torch.Generator().manual_seed(7)
    host = torch.randint(0, shape.num_experts, (host_tokens, shape.num_hidden_layers, shape.topk), generator=gen)
    host = host.to(torch.int32)
    layer_slots = list(shape.moe_layers) if shape.first_moe_layer else None
    lo, hi = shape.first_moe_layer, shape.num_hidden_layers
    host_np = host.numpy()
    rows = []
    for n in lengths:
        slots = torch.randperm(host_tokens, generator=gen)[: n - 1]
        slots_np = slots.numpy()
        plugin = to_spool_rows(gather_slots(host, slots), layer_slots, shape.dtype)
        fused = host_np[slots_np, lo:hi].astype(shape.dtype)
        if not np.array_equal(plugin, fused):
            raise AssertionError("fused gather differs from the plugin's compaction")
        r = max(3, reps * 1024 // n)
        rows.append(
            {
                "model": shape.name,
                "tokens": n,
                "upstream_gather_ms": _cpu_ms(lambda s=slots: host[s], r),
                "plugin_gather_compact_ms": _cpu_ms(
                    lambda s=slots: to_spool_rows(gather_slots(host, s), layer_slots, shape.dtype), r
                ),
                "fused_numpy_ms": _cpu_ms(lambda s=slots_np: host_np[s, lo:hi].astype(shape.dtype), r),
            }
        )
    return rows


def live_compaction(shape: ModelShape, batch: int, reps: int) -> dict:
    """Thread-CPU µs to compact one decode step of `batch` requests: per request, or once per step."""
    from engine_ext.sglang.gather import to_spool_rows

    gen = torch.Generator().manual_seed(11)
    step = torch.randint(0, shape.num_experts, (batch, shape.num_hidden_layers, shape.topk), generator=gen)
    step = step.to(torch.int32)
    layer_slots = list(shape.moe_layers) if shape.first_moe_layer else None
    lo, hi = shape.first_moe_layer, shape.num_hidden_layers

    def per_request() -> list[np.ndarray]:
        return [to_spool_rows(step[i : i + 1], layer_slots, shape.dtype) for i in range(batch)]

    def per_step() -> list[np.ndarray]:
        rows = step.numpy()[:, lo:hi].astype(shape.dtype)
        return [rows[i : i + 1] for i in range(batch)]

    if not all(np.array_equal(a, b) for a, b in zip(per_request(), per_step(), strict=True)):
        raise AssertionError("per-step compaction differs from the plugin's")
    return {
        "model": shape.name,
        "batch": batch,
        "per_request_us": _cpu_ms(per_request, reps) * 1e3,
        "per_step_us": _cpu_ms(per_step, reps) * 1e3,
    }
