"""The budget against real SGLang 0.5.23: the resolution hook on a real `ServerArgs` resolution, and the CLI.

Each group runs in one fresh interpreter (`sglang_env.run_sglang`): SGLang's resolution hooks and env vars are
process-global. Expected numbers are written out; the tiny Qwen3-MoE resolves on CPU with a decode graph of
max_bs 32 and a context of 512 (its max_position_embeddings).
"""

from __future__ import annotations

import pytest
from sglang_env import TINY_MODEL, run_sglang

pytestmark = pytest.mark.sglang

_RESOLVE = f"""
import io, logging
from engine_ext.sglang.hooks import table
from engine_ext.core.settings import EngineSettings
from sglang.srt.server_args import ServerArgs

table.install_budget_hooks(EngineSettings())
table.install_budget_hooks(EngineSettings())  # register() runs in several processes: one registration each
stream = io.StringIO()
log = logging.getLogger("r3_sidecar")
log.addHandler(logging.StreamHandler(stream))
log.setLevel(logging.INFO)
T = {str(TINY_MODEL)!r}
base = dict(model_path=T, device="cpu", skip_tokenizer_init=True, enable_return_routed_experts=True)

def resolve(**kw):
    stream.seek(0)
    stream.truncate(0)
    try:
        ServerArgs(**base, **kw).resolve_once()
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {{"log": stream.getvalue(), "refused": refused}}

eagle = dict(tp_size=8, attn_dp_size=8, chunked_prefill_size=8192, max_running_requests=4096,
             speculative_algorithm="EAGLE", speculative_draft_model_path=T, speculative_num_steps=3,
             speculative_eagle_topk=1, speculative_num_draft_tokens=4, max_total_tokens=8192)
deepep = dict(tp_size=2, ep_size=2, moe_a2a_backend="deepep", max_running_requests=1024, chunked_prefill_size=4096)
"""


def _row(log: str, buffer: str) -> list[str]:
    lines = [line.split() for line in log.splitlines() if line.startswith(buffer + " ")]
    assert len(lines) == 1, log
    return lines[0]


def test_resolution_hook_enforce_refuses_what_the_plugin_cannot_correct():
    code = _RESOLVE + 'emit({"eagle": resolve(**eagle), "deepep": resolve(**deepep)})'
    (result,) = run_sglang(code, env={"R3_BUDGET": "enforce"})
    eagle, deepep = result["eagle"], result["deepep"]

    # DP8 EAGLE w=4: --chunked-prefill-size 8192 -> 1024 per rank; 4096 requests -> 512 per rank.
    assert eagle["refused"] is None  # the only shortfall is the device cache, which the plugin sizes itself
    assert eagle["log"].count("r3-sidecar buffer budget:") == 1
    device = _row(eagle["log"], "routed_experts.device_cache")
    assert device[2:5] == [str(8 * max(1024, 512)), str(8 * max(1024, 512 * 4)), "corrected"]
    kv = _row(eagle["log"], "eagle.draft_kv_indices")  # decode graph max_bs 32, topk 1, context 512
    # seq_lens_sum <= min(32 * (512 - 2), --max-total-tokens 8192), plus bs 32 x topk 1 x 3 steps
    assert kv[3:6] == [str(32 * 1 * 512), str(min(32 * 510, 8192) * 1 + 32 * 1 * 3), "ok"]
    host = _row(eagle["log"], "routed_experts.host_cache")  # pool + page_size 1
    assert host[2:5] == [str(8192 + 1), str(8192 + 1), "ok"]

    # TP2 DeepEP, no DP attention: attn_tp 2, 1024 decode requests -> ceil(1024 / 2) = 512 tokens per rank > 128.
    assert deepep["refused"] is not None
    assert "R3_BUDGET=enforce" in deepep["refused"]
    assert "deepep.low_latency: demand 512 tokens/rank > capacity 128" in deepep["refused"]
    assert "Set SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=512." in deepep["refused"]


_CLI = (
    _RESOLVE
    + f"""
import contextlib, io, json
from engine_ext.sglang.budget.cli import main

def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return {{"code": code, "out": out.getvalue(), "err": err.getvalue()}}

dummy = ["--model-path", "dummy", "--enable-return-routed-experts"]
emit({{
    "warn": resolve(**deepep),
    "fits": run(*dummy, "--chunked-prefill-size", "8192", "--max-running-requests", "256"),
    "deepep": run(*dummy, "--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep",
                  "--max-running-requests", "1024", "--chunked-prefill-size", "4096"),
    "json": run(*dummy, "--json", "--tp-size", "8", "--attn-dp-size", "8", "--chunked-prefill-size", "8192",
                "--max-running-requests", "4096", "--speculative-algorithm", "EAGLE",
                "--speculative-num-draft-tokens", "4", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
    "rejected": run("--model-path", {str(TINY_MODEL)!r}, "--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend",
                    "mori", "--chunked-prefill-size", "8192", "--max-running-requests", "64"),
}})
"""
)


def test_warn_logs_and_starts_and_cli_exit_codes_table_and_json():
    (result,) = run_sglang(_CLI, env={"R3_BUDGET": "warn"})

    # warn: the same DeepEP launch resolves; the log shows the failing row and its fix
    warn = result["warn"]
    assert warn["refused"] is None
    assert _row(warn["log"], "deepep.low_latency")[2:6] == [
        "128",
        "512",
        "FAIL",
        "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=512",
    ]

    fits = result["fits"]
    assert fits["code"] == 0, fits
    assert "routed_experts.device_cache" in fits["out"] and "FAIL" not in fits["out"]
    assert "capacity num_dp_ranks 1 x max(chunked_prefill 8192, max_running_requests/rank 256)" in fits["out"]

    deepep = result["deepep"]
    assert deepep["code"] == 1
    assert "FAIL" in deepep["out"]
    assert "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=512" in deepep["out"]  # ceil(1024 / attn_tp 2)
    assert "1 buffer(s) fall short" in deepep["out"]

    payload = result["json"]
    assert payload["code"] == 0  # the only short buffer is one the plugin corrects
    table = __import__("json").loads(payload["out"])
    assert table["ok"] is True
    (device,) = [r for r in table["rows"] if r["buffer"] == "routed_experts.device_cache"]
    # dummy path: the CLI divides 8192 by 8 ranks -> 1024; 4096 // 8 = 512 requests x w 4.
    assert (device["capacity"], device["demand"]) == (8 * max(1024, 512), 8 * max(1024, 512 * 4))
    assert device["corrected"] is True and device["blocking"] is False and device["ok"] is False

    rejected = result["rejected"]
    assert rejected["code"] == 2
    assert "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK" in rejected["err"]
