"""Live rows: layouts (pure), and extend/decode/verify steps through real SGLang 0.5.23 classes in a subprocess.

The step driver in the child plays the scheduler's part in the order `process_batch_result_*` runs it:
`TopkCaptureOutput.finalize` (hooked), the finish hook for finished requests (hooked), then the delivery
step (`hooks.delivery.after_batch_result`), exactly what `_around_process_result` calls.
"""

from __future__ import annotations

import pytest
from sglang_env import run_sglang

from engine_ext.sglang.live import decode_layout, extend_layout, verify_layout, wants_live


def test_layouts():
    assert extend_layout([0, 3, 7], [4, 2, 1]) == ([(0, 0, 4), (3, 4, 2), (7, 6, 1)], 7)
    assert decode_layout([5, 9]) == ([(4, 0, 1), (8, 1, 1)], 2)
    assert verify_layout([5, 9], 3, [2, 1]) == ([(5, 0, 2), (9, 3, 1)], 6)


def test_opt_in():
    assert wants_live(True, None) and not wants_live(False, None)
    assert wants_live(False, {"r3_live_rows": True})
    assert not wants_live(True, {"r3_live_rows": False})


def test_a_request_that_stops_appearing_is_forgotten(tmp_path):
    import torch

    from engine_ext.core.records import ModelShape
    from engine_ext.core.settings import Mode
    from engine_ext.core.writer import SpoolWriter
    from engine_ext.sglang.collect import Collector
    from engine_ext.sglang.live import LiveRows
    from service.spool import Spool

    writer = SpoolWriter(tmp_path).start()
    shape = ModelShape(num_experts=8, topk=2, layers=(0, 1), layer_slots=None)
    live = LiveRows(Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="e"))
    for rid in ("gone", "running"):
        live.begin(rid, start=0, prompt_len=3, retractions=0, first_pos=0, pool_idx=1)
        live.feed(rid, 0, torch.zeros(3, 2, 2, dtype=torch.int32), limit=10)
    for step in range(4):
        live.feed("running", 3 + step, torch.ones(1, 2, 2, dtype=torch.int32), limit=10)
        live.end_step(unseen_steps=2)
    assert sorted(live.records) == ["running"] and live.stats.forgotten == 1
    assert writer.flush()
    gone = Spool(tmp_path).read_meta("gone")
    assert gone.final and gone.status == "error" and gone.rows == 3
    assert Spool(tmp_path).read_meta("running").rows == 7 and not Spool(tmp_path).read_meta("running").final
    writer.close()


def test_stepping_aside_ends_every_record_not_yet_whole_as_error(tmp_path):
    """A hook failed (`guard.py`): a live record, a finished request whose slot read is queued, a mirror payload
    not yet handed over and a reopened rid all end `error`; no later drain reads the host cache (SGLang alone
    writes it now); a record whose rows were read before the failure stays as it is."""
    import torch

    from engine_ext.core.records import ModelShape
    from engine_ext.core.settings import Mode
    from engine_ext.core.writer import SpoolWriter
    from engine_ext.sglang.collect import Collector
    from engine_ext.sglang.collect import FinishedReq as Finished
    from engine_ext.sglang.live import LiveRows
    from service.spool import Spool

    writer = SpoolWriter(tmp_path).start()
    shape = ModelShape(num_experts=8, topk=2, layers=(0, 1), layer_slots=None)
    collector = Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="e")
    live = LiveRows(collector)
    host = torch.tensor([0, 1], dtype=torch.int32).repeat(64, 2, 1)  # every slot a true route: experts 0 and 1
    req_to_token = torch.arange(8 * 16, dtype=torch.int32).reshape(8, 16) % 64

    def finished(rid: str, idx: int) -> Finished:
        return Finished(rid=rid, wants_inline=True, start_len=0, prompt_len=4, seqlen=7, pool_idx=idx, aborted=False)

    collector.finish(finished("whole", 1), publisher=True)
    collector.end_step(req_to_token, host)
    collector.drain(wait=True)  # handed to the writer whole before the failure
    live.begin("live", start=0, prompt_len=3, retractions=0, first_pos=0, pool_idx=2)
    live.feed("live", 0, torch.tensor([0, 1], dtype=torch.int32).repeat(3, 2, 1), limit=10)
    collector.finish(finished("launched", 3), publisher=True)
    collector.end_step(req_to_token, host)  # read and drained at its step's end (a CPU copy is done at once)
    collector.finish(finished("queued", 4), publisher=True)  # queued for the next step's read
    collector.configured_mode = Mode.MIRROR
    collector.finish(finished("mirrored", 5), publisher=True)  # waits for SGLang's inline payload
    assert collector.reopen("whole", prompt_len=4, start_len=0)  # a new request under a written rid
    queued_bytes = writer.snapshot()["queued_bytes"]

    live.abandon()
    collector.abandon()
    assert collector.drain(wait=True) == 0 and not collector.gather.pending() and not live.records
    assert writer.flush()
    spool = Spool(tmp_path)
    for rid in ("live", "queued", "mirrored", "whole"):
        meta = spool.read_meta(rid)
        assert meta.final and meta.status == "error", (rid, meta)
    assert spool.read_meta("launched").status == "ok" and spool.read_meta("launched").rows == 6
    assert writer.snapshot()["queued_bytes"] <= queued_bytes
    writer.close()


_LIVE_CHILD = r"""
import base64, os, types
from array import array
import numpy as np, torch
from sglang_env import publish_args, tiny_model_config
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, FINISH_ABORT, FINISH_LENGTH
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
from engine_ext.sglang.hooks import delivery as delivery_hooks
from engine_ext.sglang.hooks import table
from engine_ext.sglang.delivery import PROCESS
from engine_ext.core.settings import EngineSettings
from service.spool import Spool

SPOOL = os.environ["R3_TEST_SPOOL"]
publish_args(chunked_prefill_size=64, max_running_requests=8, enable_return_routed_experts=True)
table.install_delivery_hooks(EngineSettings(spool_dir=SPOOL))  # live rows by per-request opt-in only
HookRegistry.apply_hooks()

mc = tiny_model_config()
mc.hf_text_config.num_experts = 8
cap = RoutedExpertsCapturer(mc, num_tokens=1024, max_running_requests=8, num_fused_shared_experts=0, device="cpu")
set_global_experts_capturer(cap)
pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
proc = SchedulerBatchResultProcessor(**{f: None for f in SchedulerBatchResultProcessor.__dataclass_fields__} | dict(
    req_to_token_pool=pool, model_config=mc, is_generation=True))
gen = torch.Generator().manual_seed(11)
free = [int(x) + 1 for x in torch.randperm(1000, generator=gen)]
spool = Spool(SPOOL)

def make(rid, idx, prompt, max_new, live=True, **kw):
    params = SamplingParams(max_new_tokens=max_new, custom_params={"r3_live_rows": True} if live else None)
    req = Req(rid, "", array("l", range(1, prompt + 1)), params, return_routed_experts=True, **kw)
    req.kv.req_pool_idx = idx
    return req

def alloc(req, lo, hi):
    slots = [free.pop() for _ in range(lo, hi)]
    pool.req_to_token[req.kv.req_pool_idx, lo:hi] = torch.tensor(slots, dtype=torch.int32)
    return slots

def forward(slots, overlap=True):
    # overlap: SGLang's default (device clones, host write at finalize); else the inline host write
    n = len(slots)
    for layer in range(2):
        cap.capture(layer, torch.rand(n, 8, generator=gen).argsort(dim=1)[:, :2].to(torch.int32))  # true routes
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64), out_cache_loc_virtual=None)
    out = cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=overlap)
    return out, fb.out_cache_loc

expected = {}
def upstream(req):
    seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    rows = cap.get_topk(req.kv.req_pool_idx, seqlen, pool, start_len=req.routed_experts_start_len)
    b64 = DetokenizerManager._b64_encode_per_request([rows])[0]
    return np.frombuffer(base64.b64decode(b64), dtype=np.int32).reshape(-1, 2, 2)

def grow(req, n, abort=False):
    req.output_ids.extend(range(100 + len(req.output_ids), 100 + len(req.output_ids) + n))
    if abort:
        req.finished_reason = FINISH_ABORT()
    elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))

def process(batch, result, out):
    if out is not None:
        out.finalize()
    for req in batch.reqs:
        if req.finished():
            expected[req.rid] = upstream(req)
            proc._maybe_collect_routed_experts(req)
    delivery_hooks.after_batch_result(proc, batch, result, out)

def extend(items, overlap=True):   # items: (req, prefix_len, extend_len, completes_prompt)
    slots = []
    for req, prefix, n, _ in items:
        slots += alloc(req, prefix, prefix + n)
    out, loc = forward(slots, overlap)
    for req, _, _, last in items:
        if last:
            grow(req, 1)
    batch = ScheduleBatch(reqs=[r for r, *_ in items], prefix_lens=[p for _, p, _, _ in items],
                          extend_lens=[n for _, _, n, _ in items], forward_mode=ForwardMode.EXTEND,
                          out_cache_loc=loc)
    process(batch, GenerationBatchResult(), out)

def decode(reqs, abort=(), overlap=True, retract=()):
    # retract: overlap scheduling retracts while scheduling the next batch, before this result is processed;
    # SGLang then skips those requests' tokens (batch_result_processor: `req.finished() or req.is_retracted`)
    slots, seq = [], []
    for req in reqs:
        p = len(req.origin_input_ids) + len(req.output_ids) - 1
        slots += alloc(req, p, p + 1)
        seq.append(p + 1)
    out, loc = forward(slots, overlap)
    for req in reqs:
        if req.rid in retract:
            req.kv.req_pool_idx = None       # retraction releases the KV first
            req.reset_for_retract()
        else:
            grow(req, 1, abort=req.rid in abort)
    batch = ScheduleBatch(reqs=list(reqs), seq_lens_cpu=torch.tensor(seq), forward_mode=ForwardMode.DECODE,
                          out_cache_loc=loc)
    process(batch, GenerationBatchResult(), out)

def verify(req, stride, accept):
    p = len(req.origin_input_ids) + len(req.output_ids) - 1   # the committed KV length
    slots = [free.pop() for _ in range(stride)]
    out, _ = forward(slots)
    pool.req_to_token[req.kv.req_pool_idx, p : p + accept] = torch.tensor(slots[:accept], dtype=torch.int32)
    grow(req, accept)
    batch = ScheduleBatch(reqs=[req], seq_lens_cpu=torch.tensor([p]), forward_mode=ForwardMode.TARGET_VERIFY)
    process(batch, GenerationBatchResult(accept_lens=torch.tensor([accept]), speculative_num_draft_tokens=stride), out)

def meta(rid):
    PROCESS.delivery.writer.flush()
    m = spool.read_meta(rid)
    return None if m is None else dict(rows=m.rows, final=m.final, status=m.status, start=m.start)

res = {}
a = make("a", 1, 6, 4)
b = make("b", 2, 8, 4)                      # shares a's first 3 prompt positions (a prefix-cache hit)
c = make("c", 3, 9, 3, routed_experts_start_len=2)
g = make("g", 4, 5, 3, live=False)          # did not opt in: the finish-time path
extend([(a, 0, 6, True), (g, 0, 5, True)])
pool.req_to_token[2, 0:3] = pool.req_to_token[1, 0:3]
extend([(b, 3, 5, True), (c, 0, 4, False)])  # c: the first of two prefill chunks
res["b_after_prefix"] = meta("b")
decode([a, g])
res["a_streaming"] = meta("a")
extend([(c, 4, 5, True)])
decode([a, b, c, g])                         # g finishes
decode([a, b, c])                            # a and c finish
res["c_final"] = meta("c")
decode([b])                                  # b finishes

# verify: two speculative steps, then a decode to the finish
f = make("f", 5, 5, 7)
extend([(f, 0, 5, True)])
verify(f, 3, 2)
verify(f, 3, 3)
decode([f])

# retraction: the record starts over at the re-prefill; its rows are the recompute's, as SGLang's are
d = make("d", 6, 5, 5)
extend([(d, 0, 5, True)])
decode([d]); decode([d])
res["d_before_retract"] = meta("d")
d.kv.req_pool_idx = None                     # retraction releases the KV first
d.reset_for_retract()
d.kv.req_pool_idx = 6                        # the re-prefill gets a row again
fill = len(d.origin_input_ids) + len(d.output_ids)
d.is_retracted = False
extend([(d, 0, fill, True)])                 # the re-prefill feeds prompt + outputs again
res["d_after_retract"] = meta("d")
decode([d])

# retraction in overlap order: the decode step carrying the request is processed after it was retracted
h = make("h", 5, 5, 6)
extend([(h, 0, 5, True)])
decode([h]); decode([h], retract={"h"})
res["h_after_retract_step"] = meta("h")
h.kv.req_pool_idx = 7                        # the re-prefill gets a row again
h.is_retracted = False
extend([(h, 0, len(h.origin_input_ids) + len(h.output_ids), True)])
res["h_after_reprefill"] = meta("h")
while not h.finished():
    decode([h])

# retraction whose re-prefill samples the last token: the request finishes at its first extend, which begins no
# new record; the finish hook already chose the live record, so that step must end it (found on the real server)
k = make("k", 3, 5, 3)
extend([(k, 0, 5, True)])
decode([k])
k.kv.req_pool_idx = None
k.reset_for_retract()
k.kv.req_pool_idx = 3
k.is_retracted = False
extend([(k, 0, len(k.origin_input_ids) + len(k.output_ids), True)])   # grows its third and last token

# abort: ends `aborted` with every row so far
e = make("e", 7, 4, 9)
extend([(e, 0, 4, True)])
decode([e]); decode([e], abort={"e"})

# non-overlap scheduling: the forward's inline host write keeps its rows for the batch result
z = make("z", 1, 7, 3)
extend([(z, 0, 7, True)], overlap=False)
res["z_streaming"] = meta("z")
decode([z], overlap=False); decode([z], overlap=False)

for req in (a, b, c, g, f, d, h, k, e, z):
    m = spool.read_meta(req.rid) if meta(req.rid) else None
    rows = spool.read_array(m).astype(np.int32)
    res[req.rid] = dict(rows=m.rows, final=m.final, status=m.status, start=m.start,
                        equal=bool(np.array_equal(rows, expected[req.rid])), n_up=int(expected[req.rid].shape[0]))
st = PROCESS.delivery.live.stats
res["stats"] = dict(records=st.records, completed=st.completed, restarted=st.restarted, broken=st.broken)
res["open"] = sorted(PROCESS.delivery.live.records)
res["writer"] = PROCESS.delivery.writer.snapshot()
emit(res)
"""


@pytest.mark.sglang
def test_live_rows_match_the_finish_time_path(tmp_path):
    (res,) = run_sglang(_LIVE_CHILD, env={"R3_TEST_SPOOL": str(tmp_path / "spool")})
    # rows appear while the request runs
    assert res["b_after_prefix"] == {"rows": 8, "final": False, "status": "ok", "start": 0}
    assert res["a_streaming"] == {"rows": 7, "final": False, "status": "ok", "start": 0}
    # every record, live or not, holds exactly SGLang's own rows (base64 path, decoded)
    cases = [("a", 9, 0), ("b", 11, 0), ("c", 9, 2), ("g", 7, 0), ("f", 11, 0), ("d", 9, 0), ("h", 10, 0), ("z", 9, 0)]
    cases.append(("k", 7, 0))  # finished at its re-prefill: ended by that step, written whole
    for rid, n_rows, start in cases:
        assert res[rid] == {
            "rows": n_rows,
            "final": True,
            "status": "ok",
            "start": start,
            "equal": True,
            "n_up": n_rows,
        }, rid
    assert res["c_final"]["final"] is True
    assert res["e"] == {"rows": 6, "final": True, "status": "aborted", "start": 0, "equal": True, "n_up": 6}
    # retraction: the re-prefill started the record over (never final in between), rows from the recompute
    assert res["d_before_retract"] == {"rows": 7, "final": False, "status": "ok", "start": 0}
    assert res["d_after_retract"] == {"rows": 8, "final": False, "status": "ok", "start": 0}
    # overlap order: the step processed after the retraction neither feeds nor ends the record; it restarts
    assert res["h_after_retract_step"] == {"rows": 6, "final": False, "status": "ok", "start": 0}
    assert res["h_after_reprefill"] == {"rows": 7, "final": False, "status": "ok", "start": 0}
    assert res["z_streaming"] == {"rows": 7, "final": False, "status": "ok", "start": 0}
    # k's live record broke at its finish (rows of before the retraction) and the finish-time path wrote it whole
    assert res["stats"] == {"records": 9, "completed": 8, "restarted": 2, "broken": 1}
    assert res["open"] == []
    assert res["writer"]["queued_bytes"] == 0 and res["writer"]["fallback_inline"] == 0
