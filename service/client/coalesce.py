"""Concurrent `AsyncRoutedExpertsClient.get` calls to one sidecar, sent as one `POST /routed_experts/batch`.

Why: 64 separate requests are 64 bodies read on the reader threads at once, and the loop stalls behind their
allocations and page faults; one batch is one body of frames (BENCHMARKS.md, "Trainer API"). The first call
goes at once (a lone `get` waits for nothing); only the calls made after it before the loop next runs are
joined, and only those a batch can carry (`requests.batch_key`). Each caller gets its own frame's rows or error;
a batch the server refuses whole (a 4xx/5xx status, not a frame) is sent again as each caller's own `GET`, so
each gets the error its own request earns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

from service.client import calls as req
from service.client.calls import BatchItem, BatchKey, Call
from service.client.decoding import Frame
from service.client.errors import R3Error

__all__ = ["Coalescer"]

ALONE = object()
"""A waiter's outcome when its call goes its own way: the caller sends its own `GET`."""


class Coalescer:
    """Per batch key, the calls that follow a first one before the loop next runs, sent as one batch.

    The first call of a loop turn is sent at once as its own `GET` (a lone call waits for nothing); it marks
    the turn, and the calls made after it in the same turn are queued and flushed as one batch on the next."""

    def __init__(self, batch: Callable[[Call], Awaitable[list[Frame]]], max_batch: int = 1024) -> None:
        self._batch = batch  # sends a batch `Call` under the client's retry policy
        self._max = max_batch  # the server's default `R3_MAX_BATCH`
        self._queues: dict[BatchKey, list[tuple[BatchItem, asyncio.Future[object]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def frame(self, call: Call) -> Frame | None:
        """This call's frame from a shared batch, or None when it goes alone (by itself, or refused as a batch)."""
        key = req.batch_key(call)
        if key is None:
            return None
        queue = self._queues.get(key)
        if queue is None:  # the first call of this loop turn goes at once, alone: a lone `get` waits for nothing
            self._queues[key] = []
            asyncio.get_running_loop().call_soon(self._flush, key)
            return None
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        queue.append((req.batch_item(call), fut))
        outcome = await fut
        return None if outcome is ALONE else cast(Frame, outcome)

    def _flush(self, key: BatchKey) -> None:
        waiting = [(item, fut) for item, fut in self._queues.pop(key) if not fut.done()]
        for i in range(0, len(waiting), self._max):
            group = waiting[i : i + self._max]
            if len(group) == 1:
                group[0][1].set_result(ALONE)
                continue
            task = asyncio.ensure_future(self._send(key, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            futs = [fut for _, fut in group]
            for fut in futs:
                fut.add_done_callback(lambda _, t=task, fs=futs: _cancel_if_abandoned(t, fs))

    async def _send(self, key: BatchKey, group: list[tuple[BatchItem, asyncio.Future[object]]]) -> None:
        layers, wait, clamp = key
        items = [item for item, _ in group]
        try:
            frames: list[object] = list(await self._batch(req.batch_call(items, wait, layers, clamp)))
            if len(frames) != len(group):
                raise R3Error(f"the batch answered {len(frames)} frames for {len(group)} rids")
        except R3Error:
            frames = [ALONE] * len(group)
        except asyncio.CancelledError:
            for _, fut in group:
                fut.cancel()
            raise
        except Exception as exc:  # a transport error after its retries: each caller's own would be the same
            for _, fut in group:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), frame in zip(group, frames, strict=True):
            if not fut.done():
                fut.set_result(frame)


def _cancel_if_abandoned(task: asyncio.Task[None], futs: list[asyncio.Future[object]]) -> None:
    """Every caller of a batch cancelled: its request has no one left to answer."""
    if not task.done() and all(f.cancelled() for f in futs):
        task.cancel()
