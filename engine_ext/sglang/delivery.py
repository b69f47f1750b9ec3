"""The plugin's delivery state in one process: what `install` was told, and what the first batch result built.

Why one object: the scheduler's hooks need the same writer, collector, live rows and telemetry at every step,
and SGLang calls hooks as plain functions. So the process holds one `Process` (`PROCESS` below): the settings
set at `install`, and the `Delivery` created from them, once, at the first batch result that has a capturer.
Everything here takes plain values; `hooks.delivery` reads them off SGLang's objects.

    from engine_ext.sglang.delivery import PROCESS
    delivery = PROCESS.current(build)   # None until the settings ask for delivery and a capturer exists

A failure in the plugin's own code at any hook is the guard's (`engine_ext/sglang/guard.py`): SGLang's own path
from then on, and `step_aside` below ends what delivery had in flight and keeps an engine file saying so.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.core.degraded import guarded_thread
from engine_ext.core.records import ModelShape, spool_dtype
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.core.telemetry import Sources, Telemetry
from engine_ext.core.writer import SpoolWriter
from engine_ext.sglang import frontdoors
from engine_ext.sglang.build_check import BuildCheck
from engine_ext.sglang.collect import Collector
from engine_ext.sglang.live import LiveRows, wants_live
from engine_ext.sglang.timers import TIMERS
from service.spool.row_check import SGLANG_SENTINELS

log = logging.getLogger("r3_sidecar")


@dataclass(frozen=True)
class Placement:
    """Where this scheduler process sits, and what its launch allows (read from SGLang by `hooks.delivery`)."""

    publisher: bool  # attn-tp rank 0 of its DP group: the one process of the group that writes records
    dp_rank: int | None  # names the engine (`R3_ENGINE_NAME-dp<N>`); None without DP
    spec_tree: bool  # EAGLE top-k > 1: verify keeps a path through a tree, not the first accept_len rows
    unreachable: str | None  # why responses cannot carry the pointer (`frontdoors.pointer_unreachable`)
    sglang: str  # SGLang's version, for the engine file
    layout: str = ""  # the `compat` layout applied to it (`fit`)
    proven: bool = True  # a test ran this build's real server; else its first records are checked (`build_check`)
    front_door: str | None = None  # what SGLang's Rust front end leaves working (`frontdoors.rust_server_note`)


@dataclass(frozen=True)
class HostCache:
    """SGLang's routed-experts host cache, as delivery uses it: the rows tensor and two token counts."""

    rows: torch.Tensor  # `[slots, layers, topk]`, indexed by KV slot (`req_to_token`)
    tokens: Callable[[], tuple[int, int]]  # (capacity, used): for the engine file


class Delivery:
    """One scheduler process's delivery: writer thread, collector, live rows and the telemetry thread."""

    def __init__(
        self,
        settings: EngineSettings,
        shape: ModelShape,
        host_cache: HostCache,
        placement: Placement,
        *,
        budget: Callable[[], list[dict[str, Any]]],
        occupancy: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.settings = settings
        self.placement = placement
        mode = frontdoors.effective_mode(settings.mode, placement.unreachable)
        self.host_rows = host_cache.rows
        self.engine = settings.engine_name(placement.dp_rank)
        self.writer = SpoolWriter(
            settings.spool_dir,
            max_bytes=settings.spool_max_bytes,
            queue_bytes=settings.writer_queue_bytes,
            engine=self.engine,
            publish_interval_s=settings.live_publish_s,
            sentinels=SGLANG_SENTINELS,
            row_check=settings.row_check,
        ).start()
        self.collector = Collector(
            self.writer,
            shape,
            mode=mode,
            capture_all=settings.capture_all,
            dtype=spool_dtype(settings.dtype, shape.num_experts),
            engine=self.engine,
        )
        if not placement.proven:
            build = f"sglang=={placement.sglang} (layout {placement.layout}, no test ran this build)"
            self.collector.check = BuildCheck(build, settings.build_check_records)
        self.live = LiveRows(self.collector)
        self.inline_rows: tuple[object, Any] | None = None  # non-overlap: (out_cache_loc, host rows), last forward
        self.stop = threading.Event()
        ticker = guarded_thread("r3-collect-ticker", lambda: self.collector.run_ticker(self.stop))
        threading.Thread(target=ticker, name="r3-collect-ticker", daemon=True).start()
        if mode is not settings.mode and self.publisher and placement.front_door is None:
            log.warning(
                "r3-sidecar: %s; requests that ask for routed experts keep SGLang's inline payload (R3_MODE=%s "
                "acts as mirror: the spool still gets every record)",
                placement.unreachable,
                settings.mode,
            )
        self.telemetry = Telemetry(
            spool_dir=settings.spool_dir,
            engine=self.engine,
            dp_rank=placement.dp_rank,
            sources=Sources(
                budget=budget,
                occupancy=occupancy,
                host_cache=host_cache.tokens,
                writer=self.writer.snapshot,
                hooks=TIMERS.snapshot if TIMERS.on else None,
                build=self.build_report,
            ),
            interval_s=settings.telemetry_interval_s,
            sglang=placement.sglang,
            delivery=frontdoors.delivery_report(settings.mode, placement.unreachable, placement.front_door),
        )
        if self.publisher:  # one engine file per DP group, like the records
            self.telemetry.start()

    @property
    def publisher(self) -> bool:
        return self.placement.publisher

    @property
    def mode(self) -> Mode:
        """The delivery mode in effect now (an unproven build's check holds sidecar mode at mirror)."""
        return self.collector.mode

    def build_report(self) -> dict[str, Any]:
        """The engine file's `build`: the build found, the layout applied, proven or checked (and how far)."""
        check = self.collector.check
        return {
            "found": self.placement.sglang,
            "layout": self.placement.layout,
            "proven": self.placement.proven,
            "check": None if check is None else check.report(),
        }

    @property
    def dp_rank(self) -> int | None:
        return self.placement.dp_rank

    def wants_live(self, asked: bool, custom_params: Any) -> bool:
        """Does a request (`return_routed_experts`, its `custom_params`) get live rows in this process?"""
        settings = self.settings
        return (
            self.publisher
            and not self.placement.spec_tree  # tree verify rows are not a prefix: the finish-time path takes them
            and (asked or settings.capture_all)
            and wants_live(settings.live_rows, custom_params)
        )

    def abandon(self) -> None:
        """A hook failed: stop reading SGLang's host cache and end every record not yet whole as `error`.

        The writer and the telemetry thread go on: records already whole reach the spool, and the engine file
        keeps reporting, `degraded` included."""
        self.stop.set()  # the idle ticker drains no more
        self.live.abandon()
        self.collector.abandon()

    def close(self) -> None:
        """Stop the threads; what is queued is written (bounded by the writer's timeout)."""
        self.stop.set()
        self.telemetry.close()
        self.collector.drain(wait=True)
        self.writer.close()


class Process:
    """The process-wide state: the settings `install` set, and the one `Delivery` built from them."""

    def __init__(self) -> None:
        self.settings: EngineSettings | None = None
        self.delivery: Delivery | None = None
        self.reporter: Telemetry | None = None  # the engine file of a process that stepped aside with no delivery

    def configure(self, settings: EngineSettings | None) -> None:
        """Set (or, with None, clear) the settings delivery is built from; closes a delivery already built."""
        if self.delivery is not None:
            self.delivery.close()
        if self.reporter is not None:
            self.reporter.close()
        self.settings, self.delivery, self.reporter = settings, None, None

    def current(self, build: Callable[[EngineSettings], Delivery | None]) -> Delivery | None:
        """The delivery, built by `build(settings)` on first use; one attempt: a failure leaves SGLang's path."""
        if self.delivery is None and self.settings is not None:
            settings, self.settings = self.settings, None
            delivery = build(settings)  # raises: settings stay None, so SGLang's own path from here on
            self.settings = settings
            if delivery is not None:
                self.delivery = delivery
                atexit.register(delivery.close)  # a clean exit writes what is queued
        return self.delivery

    def step_aside(self, report: Callable[[], Telemetry | None]) -> None:
        """Every hook of this process fell back to SGLang's own: no delivery from now on, loudly.

        A delivery already built abandons what it had in flight, and its telemetry reports `degraded`; a process
        with no engine file of its own (`R3_MODE=off`, the main process, a delivery whose start failed, a rank
        that does not publish) starts one with `report()`."""
        self.settings = None  # no delivery is built from now on
        if self.delivery is not None:
            self.delivery.abandon()
        reporting = self.delivery is not None and self.delivery.publisher
        if not reporting and self.reporter is None:
            self.reporter = report()


PROCESS = Process()
