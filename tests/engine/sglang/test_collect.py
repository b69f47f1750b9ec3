"""Finish-time collection: pure decisions here; against real SGLang 0.5.23 classes in one subprocess."""

from __future__ import annotations

import pytest
import torch
from sglang_env import run_sglang

from engine_ext.core.records import moe_layer_ids, routed_experts_url
from engine_ext.core.settings import Mode
from engine_ext.sglang.collect import Route, choose_route, row_range
from engine_ext.sglang.gather import StepGather


def test_row_range_matches_get_topk_clamp():
    assert row_range(0, 10) == (0, 9)
    assert row_range(4, 10) == (4, 9)
    assert row_range(12, 10) == (9, 9)  # start clamps to seqlen - 1: no rows
    with pytest.raises(ValueError):
        row_range(-1, 10)


def test_moe_layers_follow_the_config():
    assert moe_layer_ids(4) == (0, 1, 2, 3)
    assert moe_layer_ids(5, first_k_dense=2) == (2, 3, 4)
    assert moe_layer_ids(6, sparse_step=2, mlp_only=[5]) == (1, 3)


@pytest.mark.parametrize(
    ("mode", "wants", "capture_all", "publisher", "reserved", "route"),
    [
        (Mode.SIDECAR, True, False, True, True, Route.SPOOL),
        (Mode.SIDECAR, True, False, True, False, Route.INLINE),
        (Mode.SIDECAR, False, False, True, None, Route.SKIP),
        (Mode.SIDECAR, False, True, True, True, Route.SPOOL),
        (Mode.SIDECAR, False, True, True, False, Route.SKIP),  # nobody asked for inline: it is never made
        (Mode.SIDECAR, True, False, False, None, Route.SKIP),  # only attn-tp rank 0 publishes
        (Mode.MIRROR, True, False, True, True, Route.BOTH),
        (Mode.MIRROR, True, False, False, None, Route.INLINE),
        (Mode.MIRROR, False, True, True, True, Route.SPOOL),
        (Mode.OFF, True, True, True, None, Route.INLINE),
    ],
)
def test_route(mode, wants, capture_all, publisher, reserved, route):
    first = choose_route(mode=mode, wants_inline=wants, capture_all=capture_all, publisher=publisher, reserved=None)
    if first == Route.SPOOL and reserved is not None:
        first = choose_route(
            mode=mode, wants_inline=wants, capture_all=capture_all, publisher=publisher, reserved=reserved
        )
    assert first == route


def test_step_gather_reads_each_step_once_in_order():
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    host = torch.arange(64 * 2 * 3, dtype=torch.int32).reshape(64, 2, 3)
    gather = StepGather()
    gather.add("a", 1, 0, 5)
    gather.add("b", 3, 2, 9)
    gather.launch(req_to_token)
    gather.add("c", 2, 4, 4)
    gather.launch(req_to_token)
    assert gather.launches == 2
    out = gather.drain(host, wait=False)
    assert [t for t, _ in out] == ["a", "b", "c"]
    assert torch.equal(out[0][1], host[16:21]) and torch.equal(out[1][1], host[50:57])
    assert out[2][1].shape == (0, 2, 3)
    assert not gather.pending()


def test_pointer_url_percent_encodes():
    assert routed_experts_url("http://sc:8000/", "a b/ü?") == "http://sc:8000/routed_experts/a%20b%2F%C3%BC%3F"


_FINISH_CHILD = r"""
import base64, types
from array import array
import numpy as np, torch
from sglang_env import publish_args, tiny_model_config
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.schedule_batch import Req, FINISH_ABORT, FINISH_LENGTH
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
from engine_ext.sglang.hooks import delivery as delivery_hooks
from engine_ext.sglang.hooks import frontdoor as frontdoor_hooks
from engine_ext.sglang.hooks import table
from engine_ext.sglang.delivery import PROCESS
from engine_ext.sglang import guard
from engine_ext.core.degraded import DEGRADED
from engine_ext.core.settings import EngineSettings
from service.spool import Spool

import os
SPOOL = os.environ["R3_TEST_SPOOL"]

publish_args(chunked_prefill_size=64, max_running_requests=8, enable_return_routed_experts=True)
table.install_delivery_hooks(EngineSettings(spool_dir=SPOOL, sidecar_url="http://sc:8000"))
HookRegistry.apply_hooks()
wanted = [h.target for h in table.HOOKS if {"delivery", "pointer"} & set(h.groups)]
unpatched = [t for t in wanted if t not in HookRegistry._patched]

mc = tiny_model_config()
mc.hf_text_config.num_experts = 8
cap = RoutedExpertsCapturer(mc, num_tokens=512, max_running_requests=8, num_fused_shared_experts=0, device="cpu")
set_global_experts_capturer(cap)
pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
proc = SchedulerBatchResultProcessor(**{f: None for f in SchedulerBatchResultProcessor.__dataclass_fields__} | dict(
    req_to_token_pool=pool, model_config=mc, is_generation=True))
gen = torch.Generator().manual_seed(7)
free = list(torch.randperm(500, generator=gen)[:400].add(1).tolist())

def forward(slots, overlap):
    # One forward writing routing for `slots` through the real capturer (overlap: TopkCaptureOutput.finalize).
    n = len(slots)
    for layer in range(2):
        cap.capture(layer, torch.rand(n, 8, generator=gen).argsort(dim=1)[:, :2].to(torch.int32))  # true routes
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64), out_cache_loc_virtual=None,
                               global_num_tokens_cpu=[0, n])  # read only under DP attention (as DP rank 1)
    out = cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=overlap)
    if overlap:
        out.finalize()

def run_request(rid, idx, prompt, output, overlap=True, **kw):
    req = Req(rid, "", array("l", range(1, prompt + 1)), SamplingParams(max_new_tokens=output), **kw)
    req.kv.req_pool_idx = idx
    slots = [free.pop() for _ in range(prompt + output)]
    pool.req_to_token[idx, : prompt + output] = torch.tensor(slots, dtype=torch.int32)
    forward(slots[:prompt], overlap)                  # extend
    for p in range(prompt, prompt + output - 1):      # decodes feed outputs 0..n-2
        forward([slots[p]], overlap)
    req.output_ids = array("l", range(100, 100 + output))
    return req

def upstream_b64(req):
    seqlen = len(req.origin_input_ids) + len(req.output_ids)
    rows = cap.get_topk(req.kv.req_pool_idx, seqlen, pool, start_len=req.routed_experts_start_len)
    return DetokenizerManager._b64_encode_per_request([rows])[0]

def spool_rows(rid):
    meta = Spool(SPOOL).read_meta(rid)
    return meta, Spool(SPOOL).read_array(meta).astype(np.int32)

def finish(reqs):
    for req in reqs:
        proc._maybe_collect_routed_experts(req)
    delivery_hooks.end_delivery_step(proc)
    PROCESS.delivery.writer.flush()

results = {"unpatched": unpatched}
def configure(**env):
    PROCESS.configure(EngineSettings(spool_dir=SPOOL, **env))

# sidecar mode: spool rows == SGLang's base64 rows; the inline payload is dropped
configure()
a = run_request("a", 1, 9, 6, return_routed_experts=True)
b = run_request("b/ü", 2, 5, 3, overlap=False, return_routed_experts=True, routed_experts_start_len=3)
c = run_request("c", 3, 4, 4)  # did not ask
b.finished_reason = FINISH_ABORT()
a.finished_reason = FINISH_LENGTH(6)
expect = {r.rid: upstream_b64(r) for r in (a, b)}
finish([a, b, c])
for r in (a, b):
    meta, rows = spool_rows(r.rid)
    up = np.frombuffer(base64.b64decode(expect[r.rid]), dtype=np.int32).reshape(-1, 2, 2)
    results[r.rid] = dict(equal=bool(np.array_equal(rows, up)), rows=meta.rows, start=meta.start,
                          status=meta.status, final=meta.final, dtype=meta.dtype, inline=r.routed_experts is not None,
                          prompt_len=meta.prompt_len, layers=list(meta.layers), nrows_up=int(up.shape[0]))
results["c_record"] = Spool(SPOOL).read_meta("c") is not None
results["sidecar_stats"] = PROCESS.delivery.writer.snapshot()
results["launches"] = PROCESS.delivery.collector.gather.launches

# capture-all: a request that did not ask is captured, and gets no inline payload
configure(capture_all=True)
d = run_request("d", 4, 6, 2)
expect_d = upstream_b64(d)
finish([d])
meta, rows = spool_rows("d")
results["d"] = dict(equal=bool(np.array_equal(rows.reshape(-1), np.frombuffer(base64.b64decode(expect_d), np.int32))),
                    inline=d.routed_experts is not None)

# mirror: inline kept and the same rows in the spool
configure(mode="mirror")
e = run_request("e", 5, 7, 3, return_routed_experts=True)
finish([e])
meta, rows = spool_rows("e")
results["e"] = dict(inline=e.routed_experts is not None,
                    equal=bool(e.routed_experts is not None and np.array_equal(rows, e.routed_experts.numpy())))

# mirror, a token sampled past the stop (max_new_tokens=0, SGLang's prefix-caching request for n>1): 0.5.23's
# payload stops at the stop (0.5.12's has a row for that token: the version suite's real servers); the record too
h = run_request("h", 6, 9, 1, return_routed_experts=True)
h.finished_len = 0
finish([h])
meta, rows = spool_rows("h")
results["h"] = dict(inline=int(h.routed_experts.shape[0]), rows=meta.rows,
                    equal=bool(np.array_equal(rows, h.routed_experts.numpy())),
                    mismatches=PROCESS.delivery.writer.snapshot()["undelivered"]["mirror_mismatch"])

# spool full: SGLang's inline path is kept and counted
configure(spool_max_bytes=64)
f = run_request("f", 6, 30, 10, return_routed_experts=True)
finish([f])
results["f"] = dict(inline=f.routed_experts is not None, record=getattr(Spool(SPOOL).read_meta("f"), "status", None),
                    stats=PROCESS.delivery.writer.snapshot())

# capture-all, spool full, and the request did not ask: nothing inline to keep, so the loss is counted by reason
configure(capture_all=True, spool_max_bytes=64)
g = run_request("g", 7, 30, 10)
finish([g])
results["g"] = dict(inline=g.routed_experts is not None, record=getattr(Spool(SPOOL).read_meta("g"), "status", None),
                    stats=PROCESS.delivery.writer.snapshot(), dropped=PROCESS.delivery.collector.dropped)

# the guard: a request the delivery cannot read (no pool row) takes SGLang's own path, the scheduler goes on,
# and every hook of the process runs SGLang's own code from then on (guard.reset: the next case starts afresh)
def degraded():
    seen = [fault["hook"] for fault in DEGRADED.snapshot()]
    guard.reset()
    return seen
configure()
broken = run_request("broken", 5, 4, 2, return_routed_experts=True)
broken.kv.req_pool_idx = None
proc._maybe_collect_routed_experts(broken)
results["contained"] = dict(
    inline=broken.routed_experts is not None, record=Spool(SPOOL).read_meta("broken") is not None,
    seen=degraded())
# a delivery that cannot start (R3_DTYPE too narrow for 300 experts) is tried once; SGLang's path stays
configure(dtype="uint8")
mc.hf_text_config.num_experts = 300
narrow = run_request("narrow", 5, 4, 2, return_routed_experts=True)
proc._maybe_collect_routed_experts(narrow)
results["narrow"] = dict(inline=narrow.routed_experts is not None, delivery=PROCESS.delivery is not None,
                         settings=PROCESS.settings is not None, seen=degraded())
mc.hf_text_config.num_experts = 8
configure(spool_max_bytes=64)
finish([run_request("f3", 6, 30, 10, return_routed_experts=True)])
results["f3"] = dict(seen=degraded(), stats=PROCESS.delivery.writer.snapshot())

# telemetry: the real delivery's engine file (budget from the published ServerArgs) is accepted by the sidecar
PROCESS.delivery.telemetry.close()  # no background write racing this one
PROCESS.delivery.telemetry.tick()
(path,) = Spool(SPOOL).engine_paths()
on_disk = Spool(SPOOL).read_engine_file(path)
results["engine_file"] = dict(engine=on_disk["engine"],
                              budget=[b["buffer"] for b in on_disk["budget"]], host_cache=on_disk["host_cache"],
                              writer=on_disk["writer"], sglang=on_disk["sglang"])

# pointer: the tokenizer manager's meta_info gets routed_experts_url for rids that asked
import asyncio
from sglang.srt.managers import tokenizer_manager as tm
from sglang.srt.managers.io_struct import GenerateReqInput
async def handle(self, recv_obj):
    metas = [{"id": rid} for rid in recv_obj.rids]
    for i, meta in enumerate(metas):
        await asyncio.sleep(0)  # not a wait: a handler yields between outputs, as SGLang's does
        tm.try_build_beam_search_out_dict(recv_obj, i, meta)
    return metas
states = {"a b/ü": types.SimpleNamespace(obj=GenerateReqInput(text="x", return_routed_experts=True)),
          "plain": types.SimpleNamespace(obj=GenerateReqInput(text="x"))}
manager = types.SimpleNamespace(rid_to_state=states)
configure(sidecar_url="http://sc:8000")
batch = types.SimpleNamespace(rids=list(states))
metas = asyncio.run(frontdoor_hooks._around_handle_batch_output(handle, manager, batch))
results["pointer"] = metas
results["outside"] = tm.try_build_beam_search_out_dict(None, 0, {"id": "a b/ü"})

# ranks: attn-tp rank 1 publishes nothing (and builds no inline payload); DP group 1 publishes as dp1
def on_rank(rid, idx, **fields):
    publish_args(chunked_prefill_size=64, max_running_requests=8, enable_return_routed_experts=True, **fields)
    set_global_experts_capturer(cap)
    configure()
    r = run_request(rid, idx, 4, 2, return_routed_experts=True)
    finish([r])
    meta = Spool(SPOOL).read_meta(rid)
    return dict(record=None if meta is None else meta.engine, inline=r.routed_experts is not None,
                publisher=PROCESS.delivery.publisher, engine=PROCESS.delivery.engine)
results["attn_tp1"] = on_rank("tp1", 1, tp_size=2, world_rank=1)
results["attn_dp1"] = on_rank("dp1", 2, tp_size=2, attn_dp_size=2, world_rank=1)
emit(results)
"""


@pytest.mark.sglang
def test_finish_path_against_sglang(tmp_path):
    (res,) = run_sglang(_FINISH_CHILD, env={"R3_TEST_SPOOL": str(tmp_path / "spool")})
    assert res["contained"] == {"inline": True, "record": False, "seen": ["_around_collect"]}, res["f3"]
    assert res["narrow"] == {"inline": True, "delivery": False, "settings": False, "seen": ["_around_collect"]}
    assert res["f3"]["seen"] == []
    assert res["unpatched"] == []  # every delivery target resolved and wrapped by HookRegistry
    a, b = res["a"], res["b/ü"]
    assert a == {**a, "equal": True, "rows": 14, "start": 0, "status": "ok", "final": True, "inline": False}
    assert a["dtype"] == "uint8" and a["prompt_len"] == 9 and a["layers"] == [0, 1] and a["nrows_up"] == 14
    assert b == {**b, "equal": True, "rows": 4, "start": 3, "status": "aborted", "inline": False}
    assert res["c_record"] is False
    assert res["sidecar_stats"] == {
        "queued_bytes": 0,
        "records_written": 2,
        "fallback_inline": 0,
        "spool_full": 0,
        "queue_full": 0,
        "write_errors": 0,
        "suspect_records": 0,
        "undelivered": {
            r: 0 for r in ("spool_full", "queue_full", "spool_not_writable", "mirror_mismatch", "write_error")
        },
    }
    assert res["launches"] == 1  # two finished requests, one batched slot read
    assert res["d"] == {"equal": True, "inline": False}
    assert res["e"] == {"inline": True, "equal": True}
    assert res["h"] == {"inline": 8, "rows": 8, "equal": True, "mismatches": 0}
    eng = res["engine_file"]
    assert eng["engine"].endswith("/dp0") and eng["sglang"] == "0.5.23", eng
    assert eng["budget"], "the budget table of the published ServerArgs"
    assert eng["host_cache"]["capacity_tokens"] == 512 and eng["writer"]["fallback_inline"] == 1
    assert res["pointer"] == [
        {"id": "a b/ü", "routed_experts_url": "http://sc:8000/routed_experts/a%20b%2F%C3%BC"},
        {"id": "plain"},
    ]
    assert res["attn_tp1"] == {**res["attn_tp1"], "record": None, "inline": False, "publisher": False}
    assert res["attn_dp1"]["publisher"] is True and res["attn_dp1"]["engine"].endswith("/dp1")
    assert res["attn_dp1"]["record"] == res["attn_dp1"]["engine"] and res["attn_dp1"]["inline"] is False
    f = res["f"]  # refused: the rows stay inline, and the record ends at once, `error` (410, never a long wait)
    assert f["inline"] is True and f["record"] == "error"
    assert f["stats"]["fallback_inline"] == 1 and f["stats"]["spool_full"] == 1
    assert f["stats"]["undelivered"]["spool_full"] == 1, "a fallback is an undelivered request too"
    g = res["g"]
    assert g["inline"] is False and g["record"] == "error" and g["dropped"] == 1
    assert g["stats"]["undelivered"]["spool_full"] == 1 and g["stats"]["fallback_inline"] == 0


def test_a_reused_rid_replaces_the_old_record_at_arrival(tmp_path):
    """verl resumes under the same rid: the old record must not be readable as the new request's once it arrives."""
    import numpy as np

    from engine_ext.core.records import ModelShape, RecordSpec
    from engine_ext.core.writer import Op, SpoolWriter
    from engine_ext.sglang.collect import Collector
    from engine_ext.sglang.collect import FinishedReq as Finished
    from service.spool import Spool

    writer = SpoolWriter(tmp_path, engine="t/dp0").start()
    shape = ModelShape(num_experts=8, topk=2, layers=(0, 1), layer_slots=None, num_hidden_layers=2)
    collector = Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="t/dp0")
    spool = Spool(tmp_path)
    try:
        assert not collector.reopen("fresh", prompt_len=3, start_len=0)  # never written: nothing to replace
        spec = RecordSpec("r", 8, 2, (0, 1), 0, 3, "uint8", "t/dp0")
        writer.submit(Op("r", spec=spec, rows=np.ones((4, 2, 2), np.uint8), status="aborted"))
        assert writer.flush()
        assert spool.read_meta("r").final and spool.read_meta("r").rows == 4
        assert collector.reopen("r", prompt_len=5, start_len=0)  # the resumed request arrives
        assert writer.flush()
        meta = spool.read_meta("r")
        assert (meta.final, meta.rows, meta.prompt_len) == (False, 0, 5)  # a reader now waits for the new rows
        # Its rows refused at finish (a spool cap of 0 bytes from here on): the record ends at once, `error`.
        writer.max_bytes, writer._capacity = 1, 1
        fin = Finished("r", wants_inline=True, start_len=0, prompt_len=5, seqlen=9, pool_idx=0, aborted=False)
        assert collector.finish(fin, publisher=True) == Route.INLINE
        assert writer.flush()
        meta = spool.read_meta("r")
        assert (meta.final, meta.status, meta.rows) == (True, "error", 0)
    finally:
        writer.close()


def test_a_rid_reused_before_its_old_record_is_written_is_still_replaced(tmp_path):
    """Under load the aborted request's final can still wait in the writer's queue when the resumed request
    arrives: `reopen` must follow it there (FIFO), not skip the replacement because nothing was written yet."""
    import torch

    from engine_ext.core.records import ModelShape
    from engine_ext.core.writer import SpoolWriter
    from engine_ext.sglang.collect import Collector
    from engine_ext.sglang.collect import FinishedReq as Finished
    from service.spool import Spool

    writer = SpoolWriter(tmp_path, engine="t/dp0")  # not started: every op waits in the queue
    shape = ModelShape(num_experts=8, topk=2, layers=(0, 1), layer_slots=None, num_hidden_layers=2)
    collector = Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="t/dp0")
    host = torch.arange(64 * 2 * 2, dtype=torch.int32).reshape(64, 2, 2) % 8
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    try:
        old = Finished("r", wants_inline=True, start_len=0, prompt_len=3, seqlen=9, pool_idx=1, aborted=True)
        assert collector.finish(old, publisher=True) == Route.SPOOL
        collector.end_step(req_to_token, host)  # the rows go to the writer's queue
        assert not writer.written("r")
        assert collector.reopen("r", prompt_len=12, start_len=0)  # the resumed request arrives
        writer.start()
        assert writer.flush()
        meta = Spool(tmp_path).read_meta("r")
        assert (meta.final, meta.rows, meta.prompt_len) == (False, 0, 12), meta  # not the aborted rows
    finally:
        writer.close()
