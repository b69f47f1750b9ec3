"""verl's and AReaL's own ingest code, fed SGLang's inline payload and the sidecar's rows for the same request.

A real SGLang 0.5.23 server in mirror mode (each response carries SGLang's inline payload and a pointer to
the plugin's record of the same request) running a model with a dense layer (GLM-4.5's layout: layer 0 dense),
so a layer axis that drops or misplaces the dense slot shows. For each request the trainer's real code builds
its tensor twice: from the inline payload, as it does today, and from the project's output (the sidecar's
`sglang_b64` body spliced into the response, or `service.client.trainers`' adapter of the fetched rows). Both must be
equal in dtype, shape and every value. verl's resume loop (`FullyAsyncLLMServerClient.generate`) runs for
real against the server, aborted part way and resumed under the same rid.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import pybase64
import pytest
import torch
import trainer_code
from sglang_abort import post_and_abort
from sglang_server import Config, Stack
from tiny_model import GLM
from waiting import wait_until

from service.client import RoutedExperts, RoutedExpertsClient, trainers

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

DENSE_MIRROR = Config("glm-mirror", env={"R3_MODE": "mirror"}, model=GLM)  # test_sglang_limits' server too

REQUESTS = {  # name → (prompt length, new tokens)
    "short": (5, 4),
    "chunked": (150, 12),  # three prefill chunks at --chunked-prefill-size 64
}


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(500 + seed).integers(3, 250, size=n).tolist()


def sidecar(stack: Stack) -> RoutedExpertsClient:
    return RoutedExpertsClient(stack.sidecar_url, timeout=30)


def record_of(client: RoutedExpertsClient, response: dict, *, timeout: float = 30.0) -> RoutedExperts:
    """The rows of this response's request, checked against the response's own prompt and token counts."""
    meta = response["meta_info"]
    rid = meta["id"]
    want = (meta["prompt_tokens"], meta["prompt_tokens"] + meta["completion_tokens"] - 1)
    last: RoutedExperts | None = None

    def matching() -> RoutedExperts | None:
        nonlocal last
        last = client.get(rid, wait=10)
        return last if (last.prompt_len, last.end) == want else None

    def described() -> str:
        return f"{rid}: prompt and end {want}, as the response says (the record's: {last.prompt_len}, {last.end})"

    return wait_until(matching, timeout, described, interval=0.02)


@pytest.fixture(scope="module")
def served(sglang_stack) -> dict:
    trainer_code.require()
    stack = sglang_stack(DENSE_MIRROR)
    out = {}
    for seed, (name, (n, new)) in enumerate(REQUESTS.items()):
        params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        response = stack.generate(  # return_logprob: as AReaL's build_generation_request asks (sglang_remote.py:71-77)
            prompt(n, seed),
            rid=f"ingest-{name}",
            return_routed_experts=True,
            return_logprob=True,
            sampling_params=params,
        )
        assert isinstance(response["meta_info"].get("routed_experts"), str), name  # mirror: inline kept
        with sidecar(stack) as client:
            rows = record_of(client, response)
        b64 = httpx.get(
            f"{stack.sidecar_url}/routed_experts/ingest-{name}", params={"format": "sglang_b64"}, timeout=30
        )
        assert b64.status_code == 200, b64.text
        out[name] = (response, rows, b64.text)
    return {"stack": stack, "requests": out}


def with_payload(response: dict, payload: str) -> dict:
    return response | {"meta_info": response["meta_info"] | {"routed_experts": payload}}


def test_areal_parse_generation_response_builds_the_same_tensor(served):
    """AReaL 1.0.4 `SGLangBackend.parse_generation_response` (areal/engine/sglang_remote.py:92-127)."""
    from areal.engine.sglang_remote import SGLangBackend

    backend = SGLangBackend()
    for name, (response, rows, b64) in served["requests"].items():
        inline = backend.parse_generation_response(response).routed_experts
        assert inline.dtype == np.int32 and inline.shape == (rows.rows, 3 * 2), name
        assert inline.reshape(rows.rows, 3, 2)[:, 0].max() == 0, name  # the dense layer's zero slot
        from_sidecar = backend.parse_generation_response(with_payload(response, b64)).routed_experts
        ours = trainers.areal(rows)
        for got in (from_sidecar, ours):
            assert got.dtype == inline.dtype and got.shape == inline.shape, name
            assert np.array_equal(got, inline), name


def verl_server_decode(response: dict, num_hidden_layers: int, topk: int) -> np.ndarray:
    """What verl 0.9.1's `SGLangHttpServer.generate` builds (async_sglang_server.py:688-699) from the inline payload.

    Its call, `extract_routed_experts_from_meta_info(output)`, lives in a SGLang module 0.5.23 does not have
    (`test_verl_server_decode_cannot_run_on_sglang_0_5_23`); SGLang's payload is base64 of int32 rows, so this is
    that function's decode, then verl's own reshape.
    """
    flat = np.frombuffer(pybase64.b64decode(response["meta_info"]["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, num_hidden_layers, topk)


def verl_as_dict(response: dict, routed_experts: np.ndarray, prompt_len: int) -> dict:
    """verl 0.9.1 `AgentLoopOutput.as_dict` (agent_loop.py:118-141) of one single-turn sample."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    ids = response["output_ids"]
    out = AgentLoopOutput(
        prompt_ids=list(range(prompt_len)),  # only its length matters to the routed experts
        response_ids=ids,
        response_mask=[1] * len(ids),
        routed_experts=routed_experts,
        metrics=AgentLoopMetrics(),
    )
    return out.as_dict()


def test_verl_agent_loop_output_builds_the_same_tensor(served):
    stack = served["stack"]
    for name, (response, rows, b64) in served["requests"].items():
        prompt_len = response["meta_info"]["prompt_tokens"]
        total = prompt_len + len(response["output_ids"])
        inline = verl_as_dict(response, verl_server_decode(response, stack.num_hidden_layers, stack.topk), prompt_len)
        spliced = verl_as_dict(
            response, verl_server_decode(with_payload(response, b64), stack.num_hidden_layers, stack.topk), prompt_len
        )
        ours = verl_as_dict(response, trainers.verl(rows), prompt_len)
        expected = inline["routed_experts"]
        assert expected.dtype == torch.int16 and expected.shape == (total, 3, 2), name
        assert expected[-1].abs().sum() == 0 and expected[: rows.rows, 1:].abs().sum() > 0, name
        for got in (
            spliced["routed_experts"],
            ours["routed_experts"],
            torch.from_numpy(trainers.verl_padded(rows, total)),
        ):
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got, expected), name


def test_verl_server_decode_cannot_run_on_sglang_0_5_23(served):
    """verl 0.9.1's two branches at async_sglang_server.py:683-699, against SGLang 0.5.23 as it answers.

    `skip_tokenizer_init`: `meta_info["routed_experts"].numpy()`, but 0.5.23's tokenizer manager base64-encodes
    the tensor for every caller (tokenizer_manager.py:2602-2609), so the value is a str. Otherwise: an import of
    `sglang.srt.layers.moe.routed_experts_capturer`, which 0.5.23 does not ship. Either way the adapter's line
    is the one that works.
    """
    response = served["requests"]["short"][0]
    assert not hasattr(response["meta_info"]["routed_experts"], "numpy")
    with pytest.raises(ModuleNotFoundError):
        __import__("sglang.srt.layers.moe.routed_experts_capturer")


# ---- verl's resume loop, for real: abort part way, resume under the same rid, concatenate ----------------------


class _Server:
    """Stands where verl's Ray handle to `SGLangHttpServer` stands: `await server.generate.remote(...)`.

    Its body is `SGLangHttpServer.generate` reduced to what the loop reads (`rid`, `max_tokens` →
    `max_new_tokens`, `return_routed_experts`; TokenOutput of output ids, routed experts, finish type), with
    the routed-experts lines replaced as the verl and AReaL pages say: the response's pointer, fetched, through
    `service.client.trainers.verl`. The first call is aborted once it has produced tokens, as a weight update does.
    """

    def __init__(self, stack: Stack) -> None:
        self.stack, self.calls, self.rids = stack, 0, []
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        params["max_new_tokens"] = params.pop("max_tokens")
        body = {"rid": request_id, "input_ids": prompt_ids, "sampling_params": params, "return_routed_experts": True}
        self.calls += 1
        self.rids.append(request_id)
        async with httpx.AsyncClient(base_url=self.stack.url, timeout=300) as http:
            if self.calls == 1:  # the first part is aborted once it decodes
                response = (await post_and_abort(http, self.stack, body)).json()
            else:
                response = (await http.post("/generate", json=body)).json()
        url = response["meta_info"]["routed_experts_url"]
        with RoutedExpertsClient(url.rsplit("/routed_experts/", 1)[0], timeout=30) as client:  # at once, no retry
            rows = await asyncio.to_thread(client.get, request_id, wait=30)
        meta = response["meta_info"]
        assert (rows.prompt_len, rows.end) == (
            meta["prompt_tokens"],
            meta["prompt_tokens"] + meta["completion_tokens"] - 1,
        )
        return TokenOutput(
            token_ids=response["output_ids"],
            routed_experts=trainers.verl(rows),
            stop_reason=response["meta_info"]["finish_reason"]["type"],
            extra_fields={"global_steps": 0},
        )


def test_verl_resume_loop_concatenates_to_the_uninterrupted_rows(served):
    """verl 0.9.1 `FullyAsyncLLMServerClient.generate` (llm_server.py:225-352; concatenation at :308-313)."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    stack, total = served["stack"], 300  # as test_sglang_plain's resume: still decoding when the abort lands
    ids = prompt(30, 9)
    params = {"max_new_tokens": total, "temperature": 0.0, "ignore_eos": True}
    whole = stack.generate(ids, rid="ingest-verl-whole", return_routed_experts=True, sampling_params=params)

    server = _Server(stack)

    class Client(FullyAsyncLLMServerClient):
        async def _acquire_server(self, request_id, **extra):
            return "replica-0", server

        def _release_server(self, server_id, request_id=None):
            pass

    rollout = SimpleNamespace(name="sglang", response_length=total, full_determinism=True)  # same rid on resume
    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=rollout))
    output = asyncio.run(
        Client(config).generate(
            "ingest-verl-resumed",
            prompt_ids=ids,
            sampling_params={"max_tokens": total, "temperature": 0.0, "ignore_eos": True},
        )
    )
    assert server.calls == 2 and server.rids == ["ingest-verl-resumed"] * 2  # aborted once, resumed under one rid
    assert output.token_ids == whole["output_ids"]  # greedy: the same tokens
    expected = stack.inline_rows(whole)  # int32, as verl's server decode gives it
    assert output.routed_experts.dtype == np.int32
    assert output.routed_experts.shape == expected.shape
    assert np.array_equal(output.routed_experts, expected)


def test_a_rid_used_again_is_never_served_the_old_requests_rows(served):
    """Abort, then a new request under the same rid, fetched through its pointer the moment SGLang answers.

    Without the plugin's arrival hook (`Collector.reopen`) about one such fetch in six got the aborted request's
    record (measured on this server): the new record reached the spool after the response did.
    """
    stack = served["stack"]
    with sidecar(stack) as client:
        for i in range(6):
            rid, ids = f"ingest-reuse-{i}", prompt(30, 20 + i)
            params = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}

            async def aborted(rid=rid, ids=ids, params=params) -> dict:
                body = {"rid": rid, "input_ids": ids, "sampling_params": params, "return_routed_experts": True}
                async with httpx.AsyncClient(base_url=stack.url, timeout=300) as http:
                    return (await post_and_abort(http, stack, body)).json()

            first = asyncio.run(aborted())
            second = stack.generate(
                ids + first["output_ids"],
                rid=rid,
                return_routed_experts=True,
                sampling_params=params | {"max_new_tokens": 20},
            )
            r = client.get(rid, wait=30)  # at once: no retry, no check before this one
            meta = second["meta_info"]
            assert (r.status, r.prompt_len, r.end) == ("ok", meta["prompt_tokens"], meta["prompt_tokens"] + 19), i
            assert np.array_equal(trainers.verl(r), stack.inline_rows(second)), i
