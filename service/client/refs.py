"""Contract 4: the trainer's handle on one output's routed experts, from any engine response to its rows.

`RoutedExpertsRef.from_response(resp)` gives one ref per output; `ref.fetch()` / `await ref.afetch()` returns
the rows: decoded locally when the response carried them (no request), else from the sidecar the pointer
names. `fetch_many` / `afetch_many` resolve many refs with one batch request per sidecar, sidecars in
parallel, over connections pooled per sidecar (`SidecarPool`, `AsyncSidecarPool`). A ref is a few strings
and ints: it pickles small and travels (Ray's object store) to the rank that needs the rows.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from service.client.calls import BatchItem, Layers
from service.client.clients import AsyncRoutedExpertsClient, RoutedExpertsClient
from service.client.decoding import RoutedExperts
from service.client.engine_responses import Inline, decode_inline, parse_response, sidecar_base, split_pointer
from service.client.errors import BadRequest, R3Error, RangeNotSatisfiable
from service.client.inline_check import check_inline
from service.wire.formats import parse_layers, resolve_layers

__all__ = [
    "AsyncSidecarPool",
    "RoutedExpertsRef",
    "SidecarPool",
    "aclose_clients",
    "afetch_many",
    "close_clients",
    "fetch_many",
]

# Inline payloads above this are decoded in a worker thread by the async path (base64 of 32k tokens of a
# 48-layer top-8 model is ~66 MB: ~0.1 s that must not run on the event loop).
_OFF_LOOP_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RoutedExpertsRef:
    """Where one output's routed experts are: inline in the response, or at `url` (the sidecar's pointer).

    `start_len` is the request's `routed_experts_start_len` (row 0 is token `start_len`; the response's own
    `routed_experts_start_len` when it says one); `num_hidden_layers` and `topk` are the model's, needed only to
    shape SGLang's flat inline string when the response says no `routed_experts_shape` (an engine without the
    plugin) and its token counts do not say the row count.
    """

    rid: str | None
    url: str | None = None
    inline: Inline | None = None
    start_len: int = 0
    prompt_len: int | None = None
    rows: int | None = None
    aborted: bool = False
    num_hidden_layers: int | None = None
    topk: int | None = None
    weight_version: str | None = None  # the engine's weight version the response names (SGLang /generate)
    num_experts: int | None = None  # the model's expert count, when the caller names it: inline rows' range check

    @classmethod
    def from_response(
        cls,
        resp: Any,
        *,
        start_len: int = 0,
        num_hidden_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
    ) -> list[RoutedExpertsRef]:
        """One ref per output of `resp`, in output order.

        `resp`: a `/generate` dict or batch list (or one request's stream chunks), an OpenAI completion or chat
        response (one ref per choice, `n > 1` included), its stream chunks or SSE text, or an offline
        `Engine.generate` result. `start_len`: the `routed_experts_start_len` the request was sent with (a
        response that says its inline rows' shape and start, as the plugin's do, needs neither it nor the
        model's numbers). `num_experts`: the model's, to check inline rows' ids against (else only impossible
        ids are caught: `service.client.inline_check`).
        """
        return [
            cls(
                rid=o.rid,
                url=o.url,
                inline=o.inline,
                start_len=o.start if o.start is not None else start_len,
                prompt_len=o.prompt_len,
                rows=o.rows,
                aborted=o.aborted,
                num_hidden_layers=num_hidden_layers,
                topk=topk,
                weight_version=o.weight_version,
                num_experts=num_experts,
            )
            for o in parse_response(resp, start_len)
        ]

    @property
    def sidecar(self) -> str | None:
        """The base URL of the sidecar that holds the rows (None when the response carried no pointer)."""
        return sidecar_base(self.url) if self.url else None

    @property
    def record_rid(self) -> str | None:
        """The rid the sidecar knows the record by (the pointer's, else the response's)."""
        return split_pointer(self.url)[1] if self.url else self.rid

    def without_inline(self) -> RoutedExpertsRef:
        """The same ref with the inline rows dropped (when a pointer exists): a small one to ship to another rank."""
        return replace(self, inline=None) if self.url else self

    # ---- resolving one ref ----------------------------------------------------------------------------

    def fetch(
        self,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        *,
        pool: SidecarPool | None = None,
        allow_suspect: bool = False,
    ) -> RoutedExperts:
        """The rows, with `RoutedExpertsClient.get`'s keywords: decoded (and checked) locally when inline, else
        fetched. Suspect rows raise `SuspectRows` unless `allow_suspect`."""
        if self.inline is not None:
            return select_rows(self._decode(allow_suspect), start, end, layers, clamp)
        client = (pool or default_pool()).client(self._remote())
        rid = self.record_rid or ""
        return client.get(rid, start=start, end=end, layers=layers, wait=wait, clamp=clamp, allow_suspect=allow_suspect)

    async def afetch(
        self,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        *,
        pool: AsyncSidecarPool | None = None,
        allow_suspect: bool = False,
    ) -> RoutedExperts:
        """`fetch` for asyncio code: never blocks the event loop (big inline payloads decode in a thread)."""
        if self.inline is not None:
            return select_rows(await self._adecode(allow_suspect), start, end, layers, clamp)
        client = (pool or default_async_pool()).client(self._remote())
        rid = self.record_rid or ""
        return await client.get(
            rid, start=start, end=end, layers=layers, wait=wait, clamp=clamp, allow_suspect=allow_suspect
        )

    def _remote(self) -> str:
        if self.url is None:
            raise R3Error(
                "the response carried neither rows nor a pointer for this output: ask with "
                "return_routed_experts=true, and set R3_SIDECAR_URL on the engine for pointers",
                rid=self.rid,
            )
        return sidecar_base(self.url)

    def _decode(self, allow_suspect: bool = False) -> RoutedExperts:
        assert self.inline is not None
        try:
            array = decode_inline(self.inline, rows=self.rows, num_hidden_layers=self.num_hidden_layers, topk=self.topk)
        except ValueError as exc:
            raise R3Error(str(exc), rid=self.rid) from None
        if not allow_suspect:
            check_inline(array, rid=self.record_rid, start=self.start_len, num_experts=self.num_experts)
        slots = int(array.shape[1])
        return RoutedExperts(
            rid=self.record_rid or "",
            array=array,
            start=self.start_len,
            prompt_len=self.prompt_len or 0,
            layers=tuple(range(slots)),
            final=True,
            dtype=array.dtype.name,
            status="aborted" if self.aborted else "ok",
            num_hidden_layers=self.num_hidden_layers or slots,
            weight_version=self.weight_version,
            source="inline",
        )

    async def _adecode(self, allow_suspect: bool = False) -> RoutedExperts:
        size = len(self.inline.data) if self.inline is not None and isinstance(self.inline.data, str) else 0
        if size > _OFF_LOOP_BYTES:
            return await asyncio.to_thread(self._decode, allow_suspect)
        return self._decode(allow_suspect)


# ---- the same keywords on inline rows ------------------------------------------------------------------


def select_rows(
    r: RoutedExperts, start: int | None, end: int | None, layers: Layers | None, clamp: bool
) -> RoutedExperts:
    """`start`/`end`/`layers`/`clamp` applied to rows in hand, with the sidecar's rules and errors (416, 422)."""
    lo = r.start if start is None else start
    hi = r.end if end is None else end
    clamped = False
    if hi < lo:
        raise RangeNotSatisfiable(f"end={hi} is before start={lo} (the rows are [{r.start}, {r.end}))", rid=r.rid)
    if clamp:
        c_lo = min(max(lo, r.start), r.end)
        c_hi = max(max(min(hi, r.end), r.start), c_lo)
        clamped, lo, hi = (c_lo, c_hi) != (lo, hi), c_lo, c_hi
    elif not r.start <= lo <= hi <= r.end:
        raise RangeNotSatisfiable(
            f"[{lo}, {hi}) is not inside the rows' [{r.start}, {r.end}) (clamp=True returns the rows that exist)",
            rid=r.rid,
        )
    array, kept = r.array[lo - r.start : hi - r.start], r.layers
    if layers is not None:
        text = layers if isinstance(layers, str) else ",".join(str(int(x)) for x in layers)
        try:
            kept = tuple(resolve_layers(r.layers, parse_layers(text)))
        except ValueError as exc:
            raise BadRequest(str(exc), rid=r.rid, status=422) from None
        slot = {layer: i for i, layer in enumerate(r.layers)}
        array = array[:, [slot[x] for x in kept], :]
    if (lo, hi) == (r.start, r.end) and kept == r.layers and not clamp:
        return r
    return replace(r, array=array, start=lo, layers=kept, clamped=clamped)


# ---- pools: one client per sidecar, kept ---------------------------------------------------------------


class SidecarPool:
    """One `RoutedExpertsClient` per sidecar base URL, kept (pooled connections); thread-safe. Close when done.

    `client_kwargs` go to every client (`token=`, `timeout=`, `retries=` …).
    """

    def __init__(self, **client_kwargs: Any) -> None:
        self._kwargs = client_kwargs
        self._clients: dict[str, RoutedExpertsClient] = {}
        self._lock = threading.Lock()

    def client(self, base_url: str) -> RoutedExpertsClient:
        base = sidecar_base(base_url)
        with self._lock:
            if base not in self._clients:
                self._clients[base] = RoutedExpertsClient(base, **self._kwargs)
            return self._clients[base]

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> SidecarPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSidecarPool:
    """One `AsyncRoutedExpertsClient` per sidecar base URL, for one event loop. `await aclose()` when done."""

    def __init__(self, **client_kwargs: Any) -> None:
        self._kwargs = client_kwargs
        self._clients: dict[str, AsyncRoutedExpertsClient] = {}

    def client(self, base_url: str) -> AsyncRoutedExpertsClient:
        base = sidecar_base(base_url)
        if base not in self._clients:
            self._clients[base] = AsyncRoutedExpertsClient(base, **self._kwargs)
        return self._clients[base]

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.aclose() for c in clients))

    async def __aenter__(self) -> AsyncSidecarPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_default: SidecarPool | None = None
_default_lock = threading.Lock()
_async_defaults: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncSidecarPool] = weakref.WeakKeyDictionary()


def _env_kwargs() -> dict[str, Any]:
    token = os.environ.get("R3_AUTH_TOKEN")
    return {"token": token} if token else {}


def default_pool() -> SidecarPool:
    """The process's pool for refs fetched without `pool=` (bearer token from `R3_AUTH_TOKEN`)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = SidecarPool(**_env_kwargs())
        return _default


def default_async_pool() -> AsyncSidecarPool:
    """The running loop's pool for refs fetched without `pool=` (one per loop: clients belong to their loop)."""
    loop = asyncio.get_running_loop()
    pool = _async_defaults.get(loop)
    if pool is None:
        pool = _async_defaults[loop] = AsyncSidecarPool(**_env_kwargs())
    return pool


def close_clients() -> None:
    """Close the default pool's connections (a later fetch opens new ones)."""
    global _default
    with _default_lock:
        pool, _default = _default, None
    if pool is not None:
        pool.close()


async def aclose_clients() -> None:
    """Close the running loop's default async pool (call before the loop ends)."""
    pool = _async_defaults.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.aclose()


# ---- many refs: one batch per sidecar, sidecars in parallel --------------------------------------------


def _groups(refs: Sequence[RoutedExpertsRef]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, ref in enumerate(refs):
        if ref.inline is None:
            groups.setdefault(ref._remote(), []).append(i)
    return groups


def _items(refs: Sequence[RoutedExpertsRef], idx: list[int], start: int | None, end: int | None) -> list[BatchItem]:
    return [BatchItem(refs[i].record_rid or "", start, end) for i in idx]


def _finish(results: list[RoutedExperts | R3Error | None], return_errors: bool) -> list[Any]:
    if not return_errors:
        for r in results:
            if isinstance(r, R3Error):
                raise r
    return results


def fetch_many(
    refs: Sequence[RoutedExpertsRef],
    start: int | None = None,
    end: int | None = None,
    layers: Layers | None = None,
    wait: float = 0,
    clamp: bool = False,
    *,
    pool: SidecarPool | None = None,
    return_errors: bool = False,
    allow_suspect: bool = False,
) -> list[RoutedExperts | R3Error]:
    """Every ref's rows, in order: inline ones decoded here, the rest one batch request per sidecar, in parallel.

    Raises the first failed ref's error, or with `return_errors=True` puts each error in its place.
    """
    pool = pool or default_pool()
    results: list[RoutedExperts | R3Error | None] = [None] * len(refs)
    groups = _groups(refs)

    def one(base: str, idx: list[int]) -> None:
        items = _items(refs, idx, start, end)
        got = pool.client(base).get_many(items, wait=wait, layers=layers, clamp=clamp, allow_suspect=allow_suspect)
        for i, r in zip(idx, got, strict=True):
            results[i] = r

    if len(groups) > 1:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="r3-fetch") as ex:
            for f in [ex.submit(one, base, idx) for base, idx in groups.items()]:
                f.result()
    else:
        for base, idx in groups.items():
            one(base, idx)
    for i, ref in enumerate(refs):
        if ref.inline is not None:
            results[i] = _or_error(
                lambda ref=ref: ref.fetch(start, end, layers, wait, clamp, allow_suspect=allow_suspect)
            )
    return _finish(results, return_errors)


async def afetch_many(
    refs: Sequence[RoutedExpertsRef],
    start: int | None = None,
    end: int | None = None,
    layers: Layers | None = None,
    wait: float = 0,
    clamp: bool = False,
    *,
    pool: AsyncSidecarPool | None = None,
    return_errors: bool = False,
    allow_suspect: bool = False,
) -> list[RoutedExperts | R3Error]:
    """`fetch_many` for asyncio code: sidecars concurrently on the loop, never blocking it."""
    pool = pool or default_async_pool()
    results: list[RoutedExperts | R3Error | None] = [None] * len(refs)

    async def one(base: str, idx: list[int]) -> None:
        items = _items(refs, idx, start, end)
        got = await pool.client(base).get_many(
            items, wait=wait, layers=layers, clamp=clamp, allow_suspect=allow_suspect
        )
        for i, r in zip(idx, got, strict=True):
            results[i] = r

    async def inline(i: int) -> None:
        try:
            results[i] = await refs[i].afetch(start, end, layers, wait, clamp, allow_suspect=allow_suspect)
        except R3Error as exc:
            results[i] = exc

    await asyncio.gather(
        *(one(base, idx) for base, idx in _groups(refs).items()),
        *(inline(i) for i, ref in enumerate(refs) if ref.inline is not None),
    )
    return _finish(results, return_errors)


def _or_error(call: Any) -> RoutedExperts | R3Error:
    try:
        return call()
    except R3Error as exc:
        return exc
