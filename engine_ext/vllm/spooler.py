"""vLLM's finished outputs to spool records, in the API server process: plain values in, no vLLM names.

Why the API server: that is where vLLM's per-step routed experts (each engine step's rows, as the scheduler
accepted them) end up joined per request (`OutputProcessor`), after the three corrections only that process
knows: rows trimmed past a stop string the detokenizer matched, the rows of an aborted request as far as the
client saw them (the worker emits one row more), and the client's request id (the engine only has a randomised
one). The record is therefore vLLM's own inline array, by construction, prefix-cache hits included (those
rows come from vLLM's block store before they reach this process). The event loop only reserves bytes and
hands the array to `engine_ext.core.writer.SpoolWriter`'s thread; the files are written there.

Modes (`R3_MODE`): `sidecar` drops the inline array once the spool has accepted the record (the response then
carries `routed_experts_url` when `R3_SIDECAR_URL` is set); `mirror` keeps both; `off` does nothing. A refused
reservation keeps the inline array in both modes and is counted in the engine file (`undelivered`). On a build no
test ran (`fit`), sidecar mode keeps the inline array too until the first records agree with it (`build_check`);
one that disagrees makes the plugin step aside: `off` from then on, the engine file saying why.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engine_ext.core.bounded_rids import BoundedRids
from engine_ext.core.build_check import PENDING
from engine_ext.core.records import Finished, ModelShape, routed_experts_url, spool_dtype
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.core.telemetry import Sources, Telemetry
from engine_ext.core.writer import Op, SpoolWriter, undelivered_reason
from engine_ext.vllm.build_check import BuildCheck
from service.spool.row_check import VLLM_SENTINELS

log = logging.getLogger("r3_sidecar.vllm")

POINTERS_KEPT = 65536
"""Spooled rids remembered for the response builder to attach their pointer (a response that is never built,
e.g. a streamed or disconnected one, must not grow this without bound)."""


def status_of(finish_reason: str | None) -> str:
    """A record's status from vLLM's finish reason (`stop`, `length`, `abort`, `error`, ...)."""
    if finish_reason == "abort":
        return "aborted"
    return "error" if finish_reason == "error" else "ok"


class Spooler:
    """One API server process's delivery: the writer thread, the engine file, the pointers to attach."""

    def __init__(
        self,
        settings: EngineSettings,
        shape: ModelShape,
        *,
        engine: str,
        vllm: str,
        row: str = "",
        proven: bool = True,
        why: str = "",
    ) -> None:
        """`why`: what more the engine file says of an unproven build (`fit.Plan.why`: the files that differ)."""
        self.settings = settings
        self.shape = shape
        self.engine = engine
        self.dtype = spool_dtype(settings.dtype, shape.num_experts)
        self.row_bytes = len(shape.layers) * shape.topk * np.dtype(self.dtype).itemsize
        self.all_layers = shape.layers == tuple(range(shape.num_hidden_layers))
        self.pointers = BoundedRids(POINTERS_KEPT)  # spooled rids, until the response builder takes the pointer
        self.build = {"found": vllm, "layout": row or vllm, "proven": proven}
        # a build no test ran checks its first records against vLLM's own inline rows (`build_check`)
        self.check = None if proven else self._check(f"vLLM {vllm} (matrix row {row}, no test ran this build)")
        self.unproven = f"vLLM {vllm}: no test ran this build (matrix row {row}){why}"
        self.aside: str | None = None  # why the plugin stepped aside in this process (`step_aside`)
        self.writer = SpoolWriter(
            settings.spool_dir,
            max_bytes=settings.spool_max_bytes,
            queue_bytes=settings.writer_queue_bytes,
            engine=engine,
            publish_interval_s=settings.live_publish_s,
            sentinels=VLLM_SENTINELS,
            row_check=settings.row_check,
        ).start()
        self.telemetry = Telemetry(
            spool_dir=settings.spool_dir,
            engine=engine,
            dp_rank=None,
            sources=Sources(writer=self.writer.snapshot, build=self.build_report),
            interval_s=settings.telemetry_interval_s,
            vllm=vllm,
            delivery=self.delivery_report(),
        ).start()

    def _check(self, build: str) -> BuildCheck:
        layers = self.shape.num_hidden_layers or len(self.shape.layers)
        return BuildCheck(build, self.settings.build_check_records, self.shape.layers, layers)

    @property
    def mode(self) -> Mode:
        """The mode in effect: off once stepped aside; mirror while an unproven build's check is pending (sidecar
        mode keeps vLLM's inline rows until its first records agree); else the configured one."""
        if self.aside is not None:
            return Mode.OFF
        if self.checking and self.settings.mode is Mode.SIDECAR:
            return Mode.MIRROR
        return self.settings.mode

    @property
    def checking(self) -> bool:
        return self.check is not None and self.check.state == PENDING

    def delivery_report(self) -> dict[str, str | None]:
        """The engine file's `delivery`: the mode in effect, the one asked for, and why vLLM's rows stay inline."""
        kept = self.aside
        if kept is None and self.mode is not self.settings.mode and self.check is not None:
            kept = f"{self.unproven}; until its first {self.check.needed} records agree with vLLM's own (build.check)"
        return {"mode": str(self.mode), "configured_mode": str(self.settings.mode), "inline_kept": kept}

    def build_report(self) -> dict[str, object]:
        """The engine file's `build`: the version found, the row applied, proven or how far its check got."""
        return self.build | {"check": None if self.check is None else self.check.report()}

    def step_aside(self, why: str) -> None:
        """The plugin's own code failed (an unproven build's check disagreed): vLLM's own path from now on in this
        process, inline rows and no records, and the engine file says why (`hooks._step_aside` logs and counts it)."""
        self.aside = f"r3-sidecar stepped aside: {why}"
        self.telemetry.delivery = self.delivery_report()

    def spool_rows(self, rows: np.ndarray | None) -> np.ndarray:
        """vLLM's array as record rows: routing layers only, the spool dtype (no copy when it already is)."""
        if rows is None:
            return np.empty((0, len(self.shape.layers), self.shape.topk), dtype=self.dtype)
        if not self.all_layers:
            rows = rows[:, list(self.shape.layers)]
        return np.ascontiguousarray(rows, dtype=self.dtype)

    def finish(self, fin: Finished) -> bool:
        """Hand one finished request's rows to the writer; True when vLLM must keep its inline array. While an
        unproven build's check is pending the record is compared first (`BuildMismatch`: nothing is written)."""
        if self.mode is Mode.OFF:
            return True
        data = self.spool_rows(fin.rows)
        if data.shape[1:] != (len(self.shape.layers), self.shape.topk):
            self.writer.note_undelivered("mirror_mismatch", rid=fin.rid, inline=True)
            log.error("r3-sidecar: %s: rows of shape %s, expected (*, %d, %d)", fin.rid, fin.rows.shape,
                      self.shape.num_hidden_layers, self.shape.topk)  # fmt: skip
            return True
        checked = self.checking
        if checked and self.check is not None and fin.rows is not None:
            self.check.compare(fin.rid, data, fin.rows)
            if not self.checking:  # this record made it agree: the configured mode from the next one
                self.telemetry.delivery = self.delivery_report()
        refusal = self.writer.reserve(data.nbytes)
        if refusal is not None:
            self.writer.note_undelivered(undelivered_reason(refusal), rid=fin.rid, inline=True)
            return True
        spec = self.shape.spec(fin, dtype=self.dtype, engine=self.engine)
        self.writer.submit(Op(fin.rid, spec=spec, rows=data, status=fin.status), reserved=True)
        if self.settings.sidecar_url:
            self.pointers.add(fin.rid)
        return checked or self.mode is Mode.MIRROR

    def pointer(self, rid: str) -> str | None:
        """The `routed_experts_url` for a choice whose record the spool accepted (once), else None."""
        if self.settings.sidecar_url and self.pointers.take(rid):
            return routed_experts_url(self.settings.sidecar_url, rid)
        return None

    def close(self) -> None:
        """Write what is queued, then the engine file once more (a server that stops says what it wrote)."""
        self.telemetry.close()
        self.writer.close()
        try:
            self.telemetry.tick()
        except OSError as exc:
            log.warning("r3-sidecar: last engine file not written: %s", exc)


def refusal_report(settings: EngineSettings, *, engine: str, vllm: str | None, reason: str) -> dict[str, Any]:
    """The engine file of a plugin that refused to load: nothing is captured, and it says why."""
    return Telemetry(
        spool_dir=settings.spool_dir,
        engine=engine,
        dp_rank=None,
        sources=Sources(),
        vllm=vllm or "",
        delivery={"mode": "off", "configured_mode": str(settings.mode), "inline_kept": reason},
    ).tick()
