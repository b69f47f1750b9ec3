"""A built-in demo engine: writes realistic records into a spool so the sidecar has something to serve.

It writes through `Spool.writer(...)`, the same writer the SGLang extension uses, so every byte the demo
sidecar serves went through the real contract. Routing is real top-k routing of random hidden states
through a seeded router (shapes of Qwen3-30B-A3B by default: 48 MoE layers, 128 experts, top-8, uint8;
`DemoConfig.deepseek_v3_like()` is a dense+MoE model: 61 layers, the first 3 dense, 256 experts, top-8).
Some records stream row by row (prompt rows at once, then one row per decode step); the rest are written
whole when they finish, as the extension does when live rows are off; a few are aborted part way.

It runs for as long as the demo does: the sidecar's retention expires the oldest records (`r3-sidecar demo`
sets a short TTL), and the first `keep` rids, which README's and the banner's commands name, are written
again whenever they leave the spool (acknowledged or expired), so those commands work on every run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.spool import Spool
from service.spool.engine_report import BudgetEntry, EngineReport, OccupancyEntry, WriterCounters
from service.spool.record.meta import safe_name
from service.spool.record.writer import RecordWriter

logger = logging.getLogger("r3_sidecar.demo")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Shape of the simulated model and pace of the simulated traffic."""

    num_layers: int = 48
    first_layer: int = 0
    num_experts: int = 128
    topk: int = 8
    hidden: int = 64
    concurrency: int = 4
    max_live: int = 64
    keep: int = 4  # the first `keep` rids are written again whenever they leave the spool
    max_records: int | None = None
    step_s: float = 0.03
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 160)
    stream_fraction: float = 0.5
    abort_fraction: float = 0.1
    telemetry_s: float = 1.0
    engine: str = "demo/dp0"
    seed: int = 0
    rid_prefix: str = "demo"
    num_hidden_layers: int | None = None  # the model's layer count; default: every layer up to the last MoE one

    @property
    def layers(self) -> list[int]:
        """The MoE layers (stored); layers below `first_layer` are dense."""
        return list(range(self.first_layer, self.first_layer + self.num_layers))

    @property
    def model_layers(self) -> int:
        return self.num_hidden_layers or self.first_layer + self.num_layers

    @classmethod
    def deepseek_v3_like(cls, **overrides: Any) -> DemoConfig:
        """DeepSeek-V3's routing shape: 61 layers, the first 3 dense (`first_k_dense_replace`), 256 experts, top-8.

        The records need SGLang's dense layers rebuilt as zero rows for `format=sglang_b64` to match SGLang.
        """
        shape: dict[str, Any] = dict(
            num_layers=58,
            first_layer=3,
            num_hidden_layers=61,
            num_experts=256,
            topk=8,
            hidden=32,
            concurrency=2,
            engine="demo-dsv3/dp0",
            rid_prefix="dsv3",
            seed=1,
            keep=2,
        )
        return cls(**{**shape, **overrides})


class Router:
    """A seeded MoE router: one `(hidden, experts)` matrix per layer plus a per-expert bias.

    The bias skews expert popularity the way trained routers are skewed, so the data is not uniform noise.
    """

    def __init__(self, cfg: DemoConfig, rng: np.random.Generator) -> None:
        self.cfg = cfg
        scale = 1.0 / np.sqrt(cfg.hidden)
        self.weights = (rng.standard_normal((cfg.num_layers, cfg.hidden, cfg.num_experts)) * scale).astype(np.float32)
        self.bias = (rng.standard_normal((cfg.num_layers, 1, cfg.num_experts)) * 0.5).astype(np.float32)
        self.drift = (rng.standard_normal((cfg.num_layers, cfg.hidden)) * 0.3).astype(np.float32)

    def route(self, hidden_states: np.ndarray) -> np.ndarray:
        """`(tokens, hidden)` float32 → `(tokens, layers, topk)` expert ids, best first (top-k order kept)."""
        cfg = self.cfg
        per_layer = hidden_states[:, None, :] + self.drift[None, :, :]
        logits = np.einsum("tlh,lhe->tle", per_layer, self.weights) + self.bias.transpose(1, 0, 2)
        top = np.argpartition(-logits, cfg.topk - 1, axis=-1)[..., : cfg.topk]
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1, kind="stable")
        return np.take_along_axis(top, order, axis=-1).astype(np.min_scalar_type(cfg.num_experts - 1))


@dataclass(slots=True)
class _Request:
    writer: RecordWriter
    prompt_len: int
    decode_steps: int
    streamed: bool
    abort_after: int | None
    done: int = 0
    pending: list[np.ndarray] = field(default_factory=list)

    def add(self, rows: np.ndarray) -> None:
        if self.streamed:
            self.writer.append(rows)
        else:
            self.pending.append(rows)

    def close(self, status: str) -> None:
        if self.pending:
            self.writer.append(np.concatenate(self.pending), publish=False)
            self.pending.clear()
        self.writer.finalize(status)


class DemoEngine:
    """Simulated decode loop on a thread: admits requests, routes their tokens, writes their rows.

    Bounded: stops admitting while `max_live` records sit in the spool (the sidecar's TTL and trainers'
    acks free them) and, when `max_records` is set, after that many records. The first `keep` rids come back:
    one that left the spool is written again, whole, in the next step.
    """

    def __init__(self, spool: Spool, cfg: DemoConfig | None = None) -> None:
        self.spool = spool
        self.cfg = cfg or DemoConfig()
        self._rng = np.random.default_rng(self.cfg.seed)
        self.router = Router(self.cfg, self._rng)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._active: list[_Request] = []
        self.created = 0
        self.rewritten = 0
        self.finished = 0
        self.aborted = 0
        self._peak_tokens = 0
        self._window_start = time.monotonic()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> DemoEngine:
        self._thread = threading.Thread(target=self._run, name="r3-demo-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still decoding are closed as aborted (as an engine shutdown would)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        next_report = 0.0
        try:
            while not self._stop.is_set():
                tick = time.monotonic()
                self.step()
                if tick >= next_report:
                    self.spool.write_engine(self.engine_report())
                    next_report = tick + self.cfg.telemetry_s
                self._stop.wait(max(0.0, self.cfg.step_s - (time.monotonic() - tick)))
        except Exception:
            logger.exception("demo engine stopped on an error")
        finally:
            for req in self._active:
                req.close("aborted")
            self._active.clear()

    # ---- one decode step ------------------------------------------------------------------------
    def step(self) -> None:
        """Admit new requests (their prompt rows), then one decode row for every running request."""
        forward_tokens = self._admit()
        running = [r for r in self._active if r.done < r.decode_steps]
        if running:
            rows = self.router.route(self._hidden(len(running)))
            for i, req in enumerate(running):
                req.add(rows[i : i + 1])
                req.done += 1
            forward_tokens += len(running)
        self._peak_tokens = max(self._peak_tokens, forward_tokens)
        still: list[_Request] = []
        for req in self._active:
            if req.abort_after is not None and req.done >= req.abort_after:
                req.close("aborted")
                self.aborted += 1
            elif req.done >= req.decode_steps:
                req.close("ok")
                self.finished += 1
            else:
                still.append(req)
        self._active = still

    def _admit(self) -> int:
        cfg = self.cfg
        names = self.spool.record_names()
        tokens = self._restore_kept(set(names))
        live = len(names)
        while (
            len(self._active) < cfg.concurrency
            and live < cfg.max_live
            and (cfg.max_records is None or self.created < cfg.max_records)
        ):
            rng = self._rng
            prompt_len = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
            output_len = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
            # Rows of a finished request: prompt_len + output_len - 1 (the last token is never an input).
            decode_steps = output_len - 1
            aborted = rng.random() < cfg.abort_fraction
            req = _Request(
                writer=self._writer(self.rid(self.created), prompt_len),
                prompt_len=prompt_len,
                decode_steps=decode_steps,
                streamed=bool(rng.random() < cfg.stream_fraction),
                abort_after=int(rng.integers(0, max(1, decode_steps))) if aborted else None,
            )
            req.add(self.router.route(self._hidden(prompt_len)))
            self._active.append(req)
            self.created += 1
            live += 1
            tokens += prompt_len
        return tokens

    def rid(self, index: int) -> str:
        return f"{self.cfg.rid_prefix}-{index:06d}"

    def _writer(self, rid: str, prompt_len: int) -> RecordWriter:
        cfg = self.cfg
        return self.spool.writer(
            rid,
            num_experts=cfg.num_experts,
            topk=cfg.topk,
            layers=cfg.layers,
            prompt_len=prompt_len,
            engine=cfg.engine,
            num_hidden_layers=cfg.model_layers,
        )

    def _restore_kept(self, names: set[str]) -> int:
        """Write again, whole and final at once, each kept rid (already created once) that left the spool."""
        cfg, rng, tokens = self.cfg, self._rng, 0
        open_rids = {req.writer.meta.rid for req in self._active}
        for index in range(min(cfg.keep, self.created)):
            rid = self.rid(index)
            if safe_name(rid) in names or rid in open_rids:
                continue
            prompt_len = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
            output_len = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
            writer = self._writer(rid, prompt_len)
            writer.append(self.router.route(self._hidden(prompt_len + output_len - 1)), publish=False)
            writer.finalize("ok")
            self.rewritten += 1
            tokens += prompt_len + output_len - 1
        return tokens

    def _hidden(self, tokens: int) -> np.ndarray:
        return self._rng.standard_normal((tokens, self.cfg.hidden), dtype=np.float32)

    # ---- telemetry ------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """An engine file (Contract 1) with the budget a Qwen3-30B-A3B server on one GPU would report."""
        return self.engine_report().to_dict()

    def engine_report(self) -> EngineReport:
        """The same report, typed; resets the device-cache peak window (a report is one window)."""
        cfg = self.cfg
        chunked_prefill, max_running, graph_max_bs, kv_tokens, page = 8192, 256, 256, 400_000, 1
        device_rows = max(chunked_prefill, max_running)
        host_rows = kv_tokens + page
        used = sum(r.prompt_len + r.done for r in self._active)
        now = time.monotonic()
        window, peak = now - self._window_start, self._peak_tokens
        self._window_start, self._peak_tokens = now, 0
        return EngineReport(
            engine=cfg.engine,
            dp_rank=0,
            pid=os.getpid(),
            sglang="demo",
            updated=time.time(),
            budget=(
                BudgetEntry(
                    "routed_experts_device_cache",
                    "rows",
                    capacity=device_rows,
                    demand=max(chunked_prefill, graph_max_bs * 1),
                    ok=True,
                    formula=f"N·max(P, graph_max_bs·w) = 1·max({chunked_prefill}, {graph_max_bs}·1)",
                ),
                BudgetEntry(
                    "routed_experts_host_cache",
                    "tokens",
                    capacity=host_rows,
                    demand=host_rows,
                    ok=True,
                    formula=f"max_token_pool_size + page_size = {kv_tokens} + {page}",
                ),
                BudgetEntry(
                    "cuda_graph_inputs",
                    "tokens",
                    capacity=graph_max_bs,
                    demand=graph_max_bs,
                    ok=True,
                    formula=f"max_bs·w = {graph_max_bs}·1",
                ),
            ),
            occupancy=(
                OccupancyEntry(
                    "routed_experts_device_cache", device_rows, min(peak, device_rows), window_s=round(window, 3)
                ),
                OccupancyEntry("routed_experts_host_cache", host_rows, used, window_s=0),
            ),
            capacity_tokens=host_rows,
            used_tokens=used,
            writer=WriterCounters(records_written=self.finished + self.aborted),
        )
