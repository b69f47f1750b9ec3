"""`format=sglang_b64` against SGLang 0.5.23's own payload, and partial-rollout resume-and-splice.

A child process drives SGLang's real classes (the capturer and its host cache, `Req`, `ReqToTokenPool`,
the batch-result processor's finish path with this plugin's hooks applied) for an all-MoE model and a
DeepSeek-V3-shaped one (first layers dense). For every request it saves SGLang's own
`meta_info["routed_experts"]` string, made by the real `DetokenizerManager._b64_encode_per_request` from the
real `get_topk` rows. The parent serves the spool the plugin wrote and compares the sidecar's body to it
byte for byte. Routing is a function of the token position, as a deterministic model's would be, so a
request aborted and resumed with `routed_experts_start_len` must splice into the uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import pybase64
import pytest
from helpers import live_server
from sglang_env import run_sglang

from service.client import RoutedExpertsClient
from service.server.settings import Settings
from service.spool import Spool

_CHILD = r"""
import os, types
from array import array
import torch
from sglang_env import publish_args, tiny_model_config
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.schedule_batch import Req, FINISH_ABORT, FINISH_LENGTH
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
from engine_ext.sglang.hooks import delivery as delivery_hooks
from engine_ext.sglang.hooks import table
from engine_ext.sglang.delivery import PROCESS
from engine_ext.core.settings import EngineSettings

SPOOL, OUT = os.environ["R3_TEST_SPOOL"], os.environ["R3_TEST_OUT"]
CHUNK = 4096
publish_args(chunked_prefill_size=CHUNK, max_running_requests=8, enable_return_routed_experts=True)
table.install_delivery_hooks(EngineSettings(spool_dir=SPOOL))
HookRegistry.apply_hooks()
results = {}

def model(name, layers, dense, experts, topk, tokens):
    mc = tiny_model_config()
    hf = mc.hf_text_config
    hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok = layers, experts, topk
    hf.first_k_dense_replace = dense  # DeepSeek's field; read by the plugin (and by DeepSeek's own model)
    cap = RoutedExpertsCapturer(mc, num_tokens=tokens, max_running_requests=8, num_fused_shared_experts=0, device="cpu")
    set_global_experts_capturer(cap)
    pool = ReqToTokenPool(size=4, max_context_len=33000, device="cpu", enable_memory_saver=False)
    proc = SchedulerBatchResultProcessor(**{f: None for f in SchedulerBatchResultProcessor.__dataclass_fields__} | dict(
        req_to_token_pool=pool, model_config=mc, is_generation=True))
    PROCESS.configure(PROCESS.settings)  # a fresh delivery for this model
    return types.SimpleNamespace(name=name, cap=cap, pool=pool, proc=proc, moe=list(range(dense, layers)),
                                 experts=experts, topk=topk, next_slot=1)

def routing(m, positions, layer):
    # A deterministic router: the experts of a token depend on its position and the layer only.
    pos = torch.as_tensor(positions, dtype=torch.int64)[:, None]
    ids = (pos * 31 + layer * 7 + torch.arange(m.topk)[None, :] * 13) % m.experts
    return ids.to(torch.int32)

def forward(m, slots, positions):
    # One forward through the real capturer: only MoE layers route (dense layers never call capture).
    for layer in m.moe:
        m.cap.capture(layer, routing(m, positions, layer))
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64), out_cache_loc_virtual=None)
    m.cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None)

def run(m, rid, prompt, output, start_len=0, abort=False):
    req = Req(rid, "", array("l", range(1, prompt + 1)), SamplingParams(max_new_tokens=max(output, 1)),
              return_routed_experts=True, routed_experts_start_len=start_len)
    req.kv.req_pool_idx = 1
    n = prompt + output
    slots = list(range(m.next_slot, m.next_slot + n))
    m.next_slot += n
    m.pool.req_to_token[1, :n] = torch.tensor(slots, dtype=torch.int32)
    for lo in range(0, prompt, CHUNK):                  # chunked prefill
        hi = min(prompt, lo + CHUNK)
        forward(m, slots[lo:hi], range(lo, hi))
    for p in range(prompt, n - 1):                      # decodes feed outputs 0..n-2
        forward(m, [slots[p]], [p])
    req.output_ids = array("l", range(100, 100 + output))
    req.finished_reason = FINISH_ABORT() if abort else FINISH_LENGTH(output)
    rows = m.cap.get_topk(1, n, m.pool, start_len=start_len)   # SGLang's own rows for this request …
    upstream = DetokenizerManager._b64_encode_per_request([rows])[0]   # … and its own encoder
    with open(os.path.join(OUT, rid + ".b64"), "w") as f:
        f.write(upstream)
    m.proc._maybe_collect_routed_experts(req)           # the plugin's finish path (sidecar mode)
    delivery_hooks.end_delivery_step(m.proc)
    PROCESS.delivery.writer.flush()
    results[rid] = dict(inline=req.routed_experts is not None, rows=int(rows.shape[0]), width=int(rows.shape[1]))

for shape in (("moe", 4, 0, 128, 8, 110_000), ("dsv3", 8, 3, 256, 8, 110_000)):
    m = model(*shape)  # one at a time: the capturer is process-global, and so is the cached HF config
    for length, starts in ((1, (0, 1)), (2, (0, 1)), (1000, (0, 1, 299, 600)), (32768, (0, 12345, 32000))):
        prompt = min(length, {1: 1, 2: 1, 1000: 600, 32768: 32000}[length])
        for s in starts:
            run(m, f"{m.name}-{length}-{s}", prompt, length - prompt, start_len=s)
    results[m.name + "-stats"] = PROCESS.delivery.writer.snapshot()

# Partial rollout: abort after 12 of 30 tokens, resume with the prompt plus what was generated,
# routed_experts_start_len = tokens - 1 (the last generated token was never an input before the abort).
m = model("splice", 8, 3, 256, 8, 4096)
run(m, "full", 50, 30)
run(m, "part-1", 50, 12, abort=True)
run(m, "part-2", 62, 18, start_len=61)
emit(results)
"""

LENGTHS = {1: (0, 1), 2: (0, 1), 1000: (0, 1, 299, 600), 32768: (0, 12345, 32000)}


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Spool, object]:
    root = tmp_path_factory.mktemp("layout")
    out = root / "upstream"
    out.mkdir()
    (res,) = run_sglang(_CHILD, env={"R3_TEST_SPOOL": str(root / "spool"), "R3_TEST_OUT": str(out)}, timeout=600)
    return res, Spool(root / "spool"), out


@pytest.mark.sglang
@pytest.mark.parametrize("name", ["moe", "dsv3"])
def test_sglang_b64_is_sglangs_payload_byte_for_byte(engine_run, name: str) -> None:
    res, spool, out = engine_run
    width = {"moe": 4, "dsv3": 8}[name]
    with live_server(Settings(spool_dir=spool.root)) as base, RoutedExpertsClient(base) as client:
        for length, starts in LENGTHS.items():
            for s in starts:
                rid = f"{name}-{length}-{s}"
                upstream = (out / f"{rid}.b64").read_bytes()
                assert res[rid]["inline"] is False, "sidecar mode: the spool took the rows"
                assert res[rid]["width"] == width
                body = client.fetch_bytes(rid, fmt="sglang_b64")
                assert body == upstream, f"{rid}: {len(body)} bytes vs SGLang's {len(upstream)}"
                if length == 1:
                    assert body == b"", "one token: no token was an input to a forward"
                meta = spool.read_meta(rid)
                assert meta.num_hidden_layers == width and meta.rows == res[rid]["rows"]
                # the same rows fetched as a range of the start-0 record: what a trainer asks with start=
                whole = client.fetch_bytes(f"{name}-{length}-0", fmt="sglang_b64", start=meta.start)
                assert whole == upstream, f"{rid}: start={meta.start} of the whole record"
                # and the client's own layout conversion agrees with SGLang's bytes
                assert pybase64.b64encode(client.get(rid).to_sglang_layout().tobytes()) == upstream
    stats = res[f"{name}-stats"]
    assert stats["fallback_inline"] == 0 and stats["records_written"] == sum(len(s) for s in LENGTHS.values())


@pytest.mark.sglang
def test_aborted_then_resumed_splices_into_the_uninterrupted_request(engine_run) -> None:
    res, spool, out = engine_run
    with live_server(Settings(spool_dir=spool.root)) as base, RoutedExpertsClient(base) as client:
        full = client.get("full")
        first = client.get("part-1", start=0)
        assert first.status == "aborted" and first.final and first.rows == res["part-1"]["rows"] == 61
        assert res["part-1"]["inline"] is False, "sidecar mode: the aborted request's rows went to the spool"
        assert client.fetch_bytes("part-1", fmt="sglang_b64") == (out / "part-1.b64").read_bytes(), (
            "an aborted request's rows so far: what SGLang returns inline for it"
        )
        second = client.get("part-2", start=61)
        assert second.status == "ok" and second.start == first.end
        spliced = np.concatenate([first.array, second.array])
        assert full.rows == 79 and spliced.shape == full.array.shape
        np.testing.assert_array_equal(spliced, full.array)
        layout = np.concatenate([first.to_sglang_layout(), second.to_sglang_layout()])
        assert pybase64.b64encode(layout.tobytes()) == (out / "full.b64").read_bytes()
        assert not layout[:, :3].any() and layout[:, 3:].any()
        parts = [client.fetch_bytes(rid, fmt="sglang_b64", start=s) for rid, s in (("part-1", 0), ("part-2", 61))]
        decoded = np.concatenate([np.frombuffer(pybase64.b64decode(p), np.int32) for p in parts])
        assert decoded.tobytes() == pybase64.b64decode((out / "full.b64").read_bytes())
