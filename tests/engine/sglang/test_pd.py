"""Prefill/decode disaggregation: each server's record holds exactly the rows its forwards routed.

SGLang 0.5.23 collects a PD request's rows on both servers: the prefill server when the KV transfer is done
(`disaggregation/prefill.py:1223-1224`, rows `[start_len, prompt_len)`: its `output_ids` hold the one token it
sampled), the decode server at finish, `[start_len, seqlen-1)` from its own host cache. The decode server never
routes the prompt (its KV arrives by transfer), so upstream's decode-side prompt rows are whatever an earlier
request left in those host-cache slots. The plugin's decode-side record starts at `prompt_len`: the pair
(prefill record `[start, P)`, decode record `[P, seqlen-1)`) is the request's exact, complete routing.

A real PD pair cannot run here (the KV transfer needs mooncake, nixl, mori or ascend: `disaggregation/utils.py:681`;
`fake` only stands in for the bootstrap of warmup requests), so each side runs in its own process on SGLang's
real classes, published with its `disaggregation_mode`, with the forwards that side would run.
"""

from __future__ import annotations

import pytest
from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

_PD_CHILD = r"""
import os, types
from array import array
import numpy as np, torch
from sglang_env import publish_args, tiny_model_config
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.schedule_batch import Req, FINISH_LENGTH
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.runtime_context import get_disagg
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
from engine_ext.sglang.hooks import delivery as delivery_hooks
from engine_ext.sglang.hooks import table
from engine_ext.sglang.delivery import PROCESS
from engine_ext.core.settings import EngineSettings
from service.spool import Spool

SPOOL, SIDE = os.environ["R3_TEST_SPOOL"], os.environ["R3_TEST_SIDE"]
publish_args(chunked_prefill_size=64, max_running_requests=8, enable_return_routed_experts=True,
             disaggregation_mode=SIDE)
table.install_delivery_hooks(EngineSettings(spool_dir=SPOOL))
HookRegistry.apply_hooks()
mc = tiny_model_config()
mc.hf_text_config.num_experts = 8
cap = RoutedExpertsCapturer(mc, num_tokens=512, max_running_requests=8, num_fused_shared_experts=0, device="cpu")
set_global_experts_capturer(cap)
pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
proc = SchedulerBatchResultProcessor(**{f: None for f in SchedulerBatchResultProcessor.__dataclass_fields__} | dict(
    req_to_token_pool=pool, model_config=mc, is_generation=True))
gen = torch.Generator().manual_seed(11)

def forward(slots):
    n = len(slots)
    for layer in range(2):
        cap.capture(layer, torch.randint(0, 8, (n, 2), dtype=torch.int32, generator=gen))
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64), out_cache_loc_virtual=None,
                               global_num_tokens_cpu=[n])
    cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True).finalize()

def configure(**env):
    PROCESS.configure(EngineSettings(spool_dir=SPOOL, **env))

def finish(req):
    proc._maybe_collect_routed_experts(req)
    delivery_hooks.end_delivery_step(proc)
    PROCESS.delivery.writer.flush()
    meta = Spool(SPOOL).read_meta(req.rid)
    return meta, Spool(SPOOL).read_array(meta).astype(np.int32)

PROMPT, OUT = 9, 5
slots = list(range(40, 40 + PROMPT + OUT))
results = {"mode": str(get_disagg().disaggregation_mode)}
forward(slots)  # an earlier request routed these slots: they hold its rows now
stale = cap.host_cache.buffer[slots].clone()
for i, mode in enumerate(("sidecar", "mirror")):
    configure(mode=mode)
    req = Req(f"pd-{mode}", "", array("l", range(1, PROMPT + 1)), SamplingParams(max_new_tokens=OUT),
              return_routed_experts=True, routed_experts_start_len=2)
    req.kv.req_pool_idx = i + 1
    pool.req_to_token[i + 1, : PROMPT + OUT] = torch.tensor(slots, dtype=torch.int32)
    if SIDE == "prefill":  # routes the prompt, samples one token, collects when the transfer is done
        forward(slots[:PROMPT])
        req.output_ids = array("l", [100])
    else:  # the prompt's KV arrived by transfer: decodes feed outputs 0..OUT-2 at positions PROMPT..
        for p in range(PROMPT, PROMPT + OUT - 1):
            forward([slots[p]])
        req.output_ids = array("l", range(100, 100 + OUT))
    req.finished_reason = FINISH_LENGTH(len(req.output_ids))
    meta, rows = finish(req)
    host = cap.host_cache.buffer[slots].numpy()
    inline = None if req.routed_experts is None else req.routed_experts.numpy()
    results[mode] = dict(
        start=meta.start, rows=meta.rows, prompt_len=meta.prompt_len,
        equal_routed=bool(np.array_equal(rows, host[meta.start : meta.start + meta.rows])),
        inline_rows=None if inline is None else int(inline.shape[0]),
        inline_prompt_is_stale=None if inline is None or SIDE == "prefill" else bool(
            np.array_equal(inline[: PROMPT - 2], stale[2:PROMPT].numpy())),
        inline_tail_equal=None if inline is None else bool(np.array_equal(inline[inline.shape[0] - meta.rows :], rows)),
    )
emit(results)
"""


def _run(side: str, tmp_path) -> dict:
    (res,) = run_sglang(_PD_CHILD, env={"R3_TEST_SPOOL": str(tmp_path / side), "R3_TEST_SIDE": side})
    return res


def test_prefill_server_records_the_prompt_rows(tmp_path):
    res = _run("prefill", tmp_path)
    assert "prefill" in res["mode"].lower()
    for mode in ("sidecar", "mirror"):
        assert res[mode]["start"] == 2 and res[mode]["rows"] == 9 - 2 and res[mode]["prompt_len"] == 9, res
        assert res[mode]["equal_routed"], res
    assert res["sidecar"]["inline_rows"] is None  # sidecar mode: dropped once spooled
    assert res["mirror"]["inline_rows"] == 7 and res["mirror"]["inline_tail_equal"]


def test_decode_server_records_only_the_rows_it_routed(tmp_path):
    res = _run("decode", tmp_path)
    assert "decode" in res["mode"].lower()
    for mode in ("sidecar", "mirror"):
        # positions 9..12: the decode forwards, not upstream's [2, 13) whose prompt part is stale
        assert (res[mode]["start"], res[mode]["rows"], res[mode]["prompt_len"]) == (9, 4, 9), res
        assert res[mode]["equal_routed"], res
    assert res["sidecar"]["inline_rows"] is None
    # upstream's inline payload (mirror keeps it) spans [2, 13); its prompt rows are the earlier request's
    assert res["mirror"]["inline_rows"] == 11 and res["mirror"]["inline_prompt_is_stale"] is True
    assert res["mirror"]["inline_tail_equal"]
