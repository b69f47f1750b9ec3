"""`LiveRows.feed_step` on plain values: the live-rows decisions of one step, with no SGLang in the process.

`test_live.py` drives the same code through SGLang's real scheduler classes; here each branch of a step
(begin at a first extend, the overlap retraction that skips a token, the re-prefill that starts over, a
retraction never seen at a prefill, a layout that does not match the rows) is one short case.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from engine_ext.core.records import ModelShape
from engine_ext.core.settings import Mode
from engine_ext.core.writer import SpoolWriter
from engine_ext.sglang.collect import Collector
from engine_ext.sglang.collect import FinishedReq as Finished
from engine_ext.sglang.live import LiveRows, StepRequest, decode_layout, extend_layout
from service.spool import Spool

EXPERTS, LAYERS, TOPK, PROMPT = 8, 3, 2, 4


def _live(spool_dir) -> tuple[LiveRows, SpoolWriter]:
    writer = SpoolWriter(spool_dir, queue_bytes=1 << 20, engine="t").start()
    shape = ModelShape(EXPERTS, TOPK, tuple(range(LAYERS)), None, LAYERS)
    return LiveRows(Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="t")), writer


def _rows(n: int, seed: int) -> torch.Tensor:
    """Rows a router could make: `TOPK` distinct ids below `EXPERTS` per token and layer (the row check's)."""
    scores = torch.rand((n, LAYERS, EXPERTS), generator=torch.Generator().manual_seed(seed))
    return scores.argsort(dim=-1)[..., :TOPK].to(torch.int32)


def _req(rid: str = "r", *, output: int = 0, **fields) -> StepRequest:
    base = StepRequest(rid, True, False, 0, False, 0, PROMPT, PROMPT + output - 1, 0)
    return replace(base, **fields)


def _prefill(live: LiveRows, req: StepRequest, rows: torch.Tensor) -> None:
    layout, total = extend_layout([0], [PROMPT])
    live.feed_step("EXTEND", layout, total, [req], rows, first_extend=True)


def _decode(live: LiveRows, req: StepRequest, row: torch.Tensor, seq_len: int) -> None:
    layout, total = decode_layout([seq_len])
    live.feed_step("DECODE", layout, total, [req], row, first_extend=False)


def _record(spool_dir, rid: str = "r"):
    meta = Spool(spool_dir).read_meta(rid)
    return meta, Spool(spool_dir).read_array(meta).astype(np.int32)


def test_a_request_that_asks_is_recorded_step_by_step_and_ends_final(tmp_path) -> None:
    live, writer = _live(tmp_path)
    prompt, d1, d2 = _rows(PROMPT, 1), _rows(1, 2), _rows(1, 3)
    _prefill(live, _req(output=1), prompt)
    _decode(live, _req(output=2), d1, PROMPT + 1)
    live.note_finish("r", Finished("r", True, 0, PROMPT, PROMPT + 3, 0, False))
    _decode(live, _req(output=3, finished=True), d2, PROMPT + 2)
    writer.flush(10)
    meta, rows = _record(tmp_path)
    assert (meta.status, meta.final, meta.rows) == ("ok", True, PROMPT + 2)
    assert np.array_equal(rows, torch.cat([prompt, d1, d2]).numpy())
    assert live.stats.completed == 1 and not live.records
    writer.close()


def test_a_request_that_did_not_ask_gets_no_live_record(tmp_path) -> None:
    live, writer = _live(tmp_path)
    _prefill(live, _req(wants=False, output=1), _rows(PROMPT, 1))
    assert not live.records and live.stats.records == 0
    writer.close()


def test_overlap_retraction_skips_the_token_and_the_re_prefill_starts_over(tmp_path) -> None:
    live, writer = _live(tmp_path)
    _prefill(live, _req(output=1), _rows(PROMPT, 1))
    _decode(live, _req(output=2, retractions=1, retracted=True), _rows(1, 2), PROMPT + 1)  # result after retraction
    assert live.stats.broken == 0 and "r" in live.records  # skipped, not ended
    again = _rows(PROMPT, 3)
    _prefill(live, _req(output=1, retractions=1), again)  # the recompute's rows replace the first prefill's
    live.note_finish("r", Finished("r", True, 0, PROMPT, PROMPT + 2, 0, False))
    last = _rows(1, 4)
    _decode(live, _req(output=2, retractions=1, finished=True), last, PROMPT + 1)
    writer.flush(10)
    meta, rows = _record(tmp_path)
    assert (meta.status, meta.rows, live.stats.restarted, live.stats.broken) == ("ok", PROMPT + 1, 1, 0)
    assert np.array_equal(rows, torch.cat([again, last]).numpy())
    writer.close()


def test_a_retraction_not_followed_by_a_prefill_breaks_the_record(tmp_path) -> None:
    live, writer = _live(tmp_path)
    _prefill(live, _req(output=1), _rows(PROMPT, 1))
    _decode(live, _req(output=2, retractions=1), _rows(1, 2), PROMPT + 1)
    writer.flush(10)
    assert live.records["r"].broken == "retracted, and not back through a prefill"
    assert Spool(tmp_path).read_meta("r").status == "error"
    writer.close()


def test_rows_that_do_not_match_the_layout_break_every_record_of_the_step(tmp_path) -> None:
    live, writer = _live(tmp_path)
    _prefill(live, _req(output=1), _rows(PROMPT, 1))
    _decode(live, _req(output=2), _rows(2, 2), PROMPT + 1)  # two rows for a one-request decode
    assert live.records["r"].broken == "DECODE: 2 rows for a layout of 1"
    assert live.stats.broken == 1
    writer.close()
