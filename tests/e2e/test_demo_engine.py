"""The demo engine on its own: real top-k routing, records that follow the spool contract, bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from waiting import wait_until

from service.server.demo import DemoConfig, DemoEngine, Router
from service.spool import Spool


def test_router_returns_the_top_k_experts_best_first() -> None:
    cfg = DemoConfig(num_layers=3, num_experts=16, topk=4, hidden=8)
    router = Router(cfg, np.random.default_rng(1))
    hidden = np.random.default_rng(2).standard_normal((6, 8), dtype=np.float32)
    got = router.route(hidden)
    logits = np.einsum("tlh,lhe->tle", hidden[:, None, :] + router.drift[None], router.weights)
    logits += router.bias.transpose(1, 0, 2)
    expected = np.argsort(-logits, axis=-1, kind="stable")[..., :4]
    assert got.dtype == np.uint8 and got.shape == (6, 3, 4)
    np.testing.assert_array_equal(got, expected)


def test_records_follow_the_contract_and_stay_bounded(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    cfg = DemoConfig(
        num_layers=4, concurrency=3, max_live=7, prompt_len=(4, 9), output_len=(2, 12), abort_fraction=0.3, seed=3
    )
    engine = DemoEngine(spool, cfg)
    grew = set()
    for _ in range(60):
        engine.step()
        for name in spool.record_names():
            meta = spool.read_meta(name)
            if not meta.final and meta.rows:
                grew.add(name)
    metas = sorted((spool.read_meta(n) for n in spool.record_names()), key=lambda m: m.rid)
    assert [m.rid for m in metas] == [f"demo-{i:06d}" for i in range(7)], "stops creating at max_live"
    assert grew, "some records are streamed: rows visible before final"
    statuses = {m.status for m in metas if m.final}
    assert statuses <= {"ok", "aborted"} and "ok" in statuses
    for meta in metas:
        rows = spool.read_array(meta)
        assert rows.shape == (meta.rows, 4, 8) and rows.dtype == np.uint8 and int(rows.max()) < 128
        assert (np.sort(rows, axis=-1)[..., 1:] != np.sort(rows, axis=-1)[..., :-1]).all(), "distinct experts"
        if meta.final and meta.status == "ok":
            # prompt rows, then one per decode step: prompt_len + output_len - 1 with output_len >= 2
            assert meta.prompt_len + 1 <= meta.rows <= meta.prompt_len + 11
    report = engine.report()
    spool.write_engine(report)
    (path,) = spool.engine_paths()
    assert spool.read_engine_file(path)["engine"] == "demo/dp0"
    assert {b["buffer"] for b in report["budget"]} >= {"routed_experts_device_cache", "routed_experts_host_cache"}


def test_deepseek_v3_like_records_say_their_dense_layers(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    engine = DemoEngine(spool, DemoConfig.deepseek_v3_like(prompt_len=(4, 8), output_len=(2, 4), max_records=2))
    for _ in range(6):
        engine.step()
    metas = [spool.read_meta(n) for n in sorted(spool.record_names())]
    assert [m.rid for m in metas] == ["dsv3-000000", "dsv3-000001"]
    for meta in metas:
        assert meta.num_hidden_layers == 61 and meta.layers == tuple(range(3, 61)) and meta.dtype == "uint8"
        assert spool.read_array(meta).shape == (meta.rows, 58, 8)
    assert DemoConfig().model_layers == 48 and spool.read_meta("dsv3-000000").sglang_layers == 61


def test_stop_closes_every_open_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    engine = DemoEngine(spool, DemoConfig(num_layers=2, step_s=0.005, output_len=(500, 600), abort_fraction=0)).start()
    try:
        wait_until(lambda: len(spool.record_names()) >= 4, 10, "four records in the spool", interval=0.01)
    finally:
        engine.stop()
    metas = [spool.read_meta(n) for n in spool.record_names()]
    assert metas and all(m.final and m.status == "aborted" for m in metas)
    assert spool.engine_paths(), "the engine file is written from the first step"


def test_the_kept_rids_come_back_whole_after_they_leave(tmp_path: Path) -> None:
    """README's blocks name demo-000000 … and acknowledge one: it must be there again for the next run."""
    spool = Spool(tmp_path)
    cfg = DemoConfig(num_layers=2, concurrency=2, max_live=6, prompt_len=(4, 6), output_len=(2, 3), keep=2)
    engine = DemoEngine(spool, cfg)
    for _ in range(20):
        engine.step()
    assert {f"demo-{i:06d}" for i in range(6)} <= set(spool.record_names())
    for rid in ("demo-000000", "demo-000001", "demo-000004"):  # acknowledged (or expired) by the sidecar
        spool.delete(rid)
    engine.step()
    names = set(spool.record_names())
    assert {"demo-000000", "demo-000001"} <= names and "demo-000004" not in names
    for rid in ("demo-000000", "demo-000001"):
        meta = spool.read_meta(rid)
        assert meta.final and meta.status == "ok" and meta.rows >= meta.prompt_len + 1  # whole at once
        assert spool.read_array(meta).shape == (meta.rows, 2, 8)
    assert engine.rewritten == 2


def test_it_keeps_producing_while_old_records_leave(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    cfg = DemoConfig(num_layers=2, concurrency=2, max_live=6, prompt_len=(4, 6), output_len=(2, 3), keep=1)
    engine = DemoEngine(spool, cfg)
    for _ in range(200):
        engine.step()
        for name in sorted(spool.record_names())[1:-4]:  # the oldest leave, as the sidecar's TTL deletes them
            if spool.read_meta(name).final:
                spool.delete(name)
    assert engine.created > 50, "still creating records long after max_live was first reached"
