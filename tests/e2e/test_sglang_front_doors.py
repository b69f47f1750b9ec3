"""Every front door of a real SGLang 0.5.23 server, in mirror and sidecar mode: rows inline or a pointer, never nothing.

The model directory carries a word-level tokenizer built by the harness (`write_tokenizer`, a chat template in
`tokenizer_config.json`), so `/generate` with text, `/v1/completions` and `/v1/chat/completions` run without
`--skip-tokenizer-init`. The same requests (greedy, fixed lengths) go to each configuration in the same order:

- upstream: the same install with no plugin (`SGLANG_PLUGINS=__none__`); its inline rows at every door are the
  reference rows, read only once it proved it ran no plugin (no pointer, an empty spool: `baseline.assert_plugin_off`).
- mirror: SGLang's inline rows at every door (`meta_info["routed_experts"]`, `sglext.routed_experts`), equal to
  upstream's, and a pointer beside them. Each door's response (a stream's chunks) decodes with
  `RoutedExpertsRef.from_response(resp)[0].fetch()`, no model numbers, and so does a continuation
  (`routed_experts_start_len`), whose start the response says.
- sidecar: no inline rows; the pointer (`meta_info["routed_experts_url"]`, `sglext.routed_experts_url(s)`) leads
  to rows equal to upstream's inline rows, for every choice of `n > 1`.
- `--tokenizer-worker-num 2` (SGLang loads no plugins in its tokenizer workers): sidecar mode keeps the inline
  rows, says so in the engine file, and the spool still gets the record; the workers import the plugin's app
  (`engine_ext.sglang.http_worker`), so those rows, and a continuation's, decode without the model's numbers.
- `--dp-size 2` (two schedulers behind SGLang's DP controller): pointers, rows equal to upstream's.
- offline `sglang.Engine`: the pointer in `meta_info`.
- `R3_CAPTURE_ALL=1` with several tokenizer workers under `R3_BUDGET=enforce`: refused at launch.
"""

from __future__ import annotations

import base64
import json
import sys
import textwrap

import httpx
import numpy as np
import pytest
from baseline import assert_same_rows
from child_process import free_port, spawn
from sglang_server import Config, Stack, server_env
from tiny_model import write_model, write_tokenizer

from service.client import RoutedExpertsRef, fetch_many

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # a start counts in its first test (minutes)

TOK = {"tokenizer": True}
UPSTREAM = Config("doors-upstream", plugin=False, sidecar=False, **TOK)
MIRROR = Config("doors-mirror", env={"R3_MODE": "mirror"}, **TOK)
SIDECAR = Config("doors-sidecar", env={"R3_MODE": "sidecar"}, **TOK)
# uvicorn kills a worker that does not answer its health ping within this many seconds (SGLang's default 10):
# importing SGLang in a fresh worker takes longer than that on a busy two-core machine
SLOW_WORKERS = {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "300"}
MULTI_TOKENIZER = Config(
    "doors-multi-tok", args={"tokenizer-worker-num": 2}, env={"R3_MODE": "sidecar"} | SLOW_WORKERS, **TOK
)
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per scheduler (SGLang asks for it past one NUMA node)
DP2 = Config("doors-dp2", args={"dp-size": 2}, env={"R3_MODE": "sidecar"} | BIND, **TOK)
REFUSED = Config(
    "doors-refused",
    args={"tokenizer-worker-num": 2},
    env={"R3_MODE": "sidecar", "R3_CAPTURE_ALL": "1", "R3_BUDGET": "enforce"},
    **TOK,
)

MAX_NEW = 6
PROMPT = "w10 w11 w12 w40 w41 w90 w91 w92 w93"
MESSAGES = [{"role": "user", "content": "w20 w21 w22 w23 w24"}]


def sampling() -> dict:
    return {"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, "return_routed_experts": True}


def sse(response: httpx.Response) -> list[dict]:
    """The JSON objects of an SSE body (`data: {...}` lines), `[DONE]` left out."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            out.append(json.loads(line[len("data: ") :]))
    assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
    return out


def door_generate(stack: Stack, model: str, extra: dict | None = None) -> list[dict]:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
        "return_routed_experts": True,
    } | (extra or {})
    resp = httpx.post(f"{stack.url}/generate", json=body, timeout=120).json()
    meta = resp["meta_info"]
    out = [{"inline": meta.get("routed_experts"), "url": meta.get("routed_experts_url"), "rid": meta["id"]}]
    return with_refs(stack, resp, out)


def door_generate_stream(stack: Stack, model: str, extra: dict | None = None) -> list[dict]:
    body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
        "return_routed_experts": True,
    } | (extra or {})
    chunks = sse(httpx.post(f"{stack.url}/generate", json=body, timeout=120))
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"] is not None
    out = [{"inline": meta.get("routed_experts"), "url": meta.get("routed_experts_url"), "rid": meta["id"]}]
    return with_refs(stack, chunks, out)


def _openai(stack: Stack, route: str, body: dict, n: int) -> list[dict]:
    """Per choice: SGLang's inline rows (first choice only, as upstream), the pointer, the rid."""
    body = body | sampling() | {"n": n}
    if not body.get("stream"):
        response = httpx.post(f"{stack.url}{route}", json=body, timeout=120).json()
        sglext = response.get("sglext") or {}
        urls = sglext.get("routed_experts_urls") or [None] * n
        assert len(response["choices"]) == n
        if sglext.get("routed_experts_url"):
            assert sglext["routed_experts_url"] == urls[0]
        out = [{"inline": sglext.get("routed_experts") if i == 0 else None, "url": urls[i]} for i in range(n)]
        return with_refs(stack, response, out)
    chunks = sse(httpx.post(f"{stack.url}{route}", json=body, timeout=120))
    rids = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            rids.setdefault(choice["index"], chunk["id"])
    sglexts = [c["sglext"] for c in chunks if c.get("sglext")]
    assert len(sglexts) <= 1, sglexts  # one response-level sglext chunk, SGLang's own or ours
    sglext = sglexts[0] if sglexts else {}
    urls = sglext.get("routed_experts_urls") or [None] * n
    out = []
    for i in range(n):
        if urls[i] is not None:  # the pointer names the rid the stream showed for that choice
            assert urls[i].endswith(f"/routed_experts/{rids[i]}"), (urls[i], rids)
        out.append({"inline": sglext.get("routed_experts") if i == 0 else None, "url": urls[i], "rid": rids[i]})
    return with_refs(stack, chunks, out)


def with_refs(stack: Stack, resp: object, answers: list[dict]) -> list[dict]:
    """Each answer plus the ref `RoutedExpertsRef.from_response` makes of the same response: same rid, pointer, rows."""
    refs = RoutedExpertsRef.from_response(resp, num_hidden_layers=stack.num_hidden_layers, topk=stack.topk)
    assert len(refs) == len(answers), (refs, answers)
    for ref, answer in zip(refs, answers, strict=True):
        assert (ref.url, ref.inline.data if ref.inline else None) == (answer["url"], answer["inline"]), (ref, answer)
        if answer.get("rid"):
            assert ref.record_rid == answer["rid"], (ref, answer)
        answer["ref"] = ref
    answers[0]["bare"] = RoutedExpertsRef.from_response(resp)[0]  # as the trainer recipes call it: no model numbers
    return answers


def door_completions(stack, model):
    return _openai(stack, "/v1/completions", {"model": model, "prompt": PROMPT}, 1)


def door_completions_stream(stack, model):
    return _openai(stack, "/v1/completions", {"model": model, "prompt": PROMPT, "stream": True}, 1)


def door_completions_n2_stream(stack, model):
    return _openai(stack, "/v1/completions", {"model": model, "prompt": PROMPT, "stream": True}, 2)


def door_chat(stack, model):
    return _openai(stack, "/v1/chat/completions", {"model": model, "messages": MESSAGES}, 1)


def door_chat_stream(stack, model):
    return _openai(stack, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "stream": True}, 1)


def door_chat_n2(stack, model):
    return _openai(stack, "/v1/chat/completions", {"model": model, "messages": MESSAGES}, 2)


DOORS = {
    "generate": door_generate,
    "generate_stream": door_generate_stream,
    "completions": door_completions,
    "completions_stream": door_completions_stream,
    "completions_n2_stream": door_completions_n2_stream,
    "chat": door_chat,
    "chat_stream": door_chat_stream,
    "chat_n2": door_chat_n2,
}


# A continuation (slime's partial rollouts): rows from this prompt position on, and the response says so.
START = 4
CONTINUED = {"routed_experts_start_len": START}
CONTINUATIONS = {
    "generate": lambda stack, model: door_generate(stack, model, CONTINUED),
    "generate_stream": lambda stack, model: door_generate_stream(stack, model, CONTINUED),
    "completions_stream": lambda stack, model: _openai(
        stack, "/v1/completions", {"model": model, "prompt": PROMPT, "stream": True} | CONTINUED, 1
    ),
    "chat": lambda stack, model: _openai(
        stack, "/v1/chat/completions", {"model": model, "messages": MESSAGES} | CONTINUED, 1
    ),
}


def knock(stack: Stack, doors: dict = DOORS) -> dict[str, list[dict]]:
    """Every door once, in `doors` order; returns per door the per-choice answers."""
    model = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return {name: door(stack, model) for name, door in doors.items()}


def rows_of(stack: Stack, answer: dict) -> np.ndarray:
    """The rows an answer gives a trainer: inline if present, else fetched through the pointer (SGLang's layout).
    A plugin-off baseline's answer must carry no pointer and leave its spool empty (`baseline.assert_plugin_off`)."""
    stack.assert_plugin_off({"routed_experts_url": answer["url"]} if answer["url"] else {})
    if answer["inline"] is not None:
        payload = answer["inline"]
    else:
        assert answer["url"], answer
        fetched = httpx.get(answer["url"], params={"format": "sglang_b64", "wait": 30}, timeout=60)
        assert fetched.status_code == 200, (answer, fetched.text)
        payload = fetched.text
    return np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(-1, stack.num_hidden_layers, stack.topk)


@pytest.fixture(scope="module")
def upstream(sglang_stack) -> dict:
    """The same requests on the same install with no plugin: every other configuration's reference rows."""
    stack = sglang_stack(UPSTREAM)
    return {"stack": stack, "answers": knock(stack)}


@pytest.fixture(scope="module")
def mirror(upstream, sglang_stack) -> dict:
    stack = sglang_stack(MIRROR)
    return {"stack": stack, "answers": knock(stack), "continued": knock(stack, CONTINUATIONS)}


@pytest.fixture(scope="module")
def sidecar(mirror, sglang_stack) -> dict:
    stack = sglang_stack(SIDECAR)
    return {"stack": stack, "answers": knock(stack)}


@pytest.fixture(scope="module")
def multi_tokenizer(sidecar, sglang_stack) -> dict:
    stack = sglang_stack(MULTI_TOKENIZER)
    return {"stack": stack, "answers": knock(stack), "continued": knock(stack, CONTINUATIONS)}


@pytest.fixture(scope="module")
def dp2(mirror, sglang_stack) -> dict:
    stack = sglang_stack(DP2)
    return {"stack": stack, "answers": knock(stack)}


def reference(upstream) -> dict[str, np.ndarray]:
    """The plugin-off server's inline rows per door (first choice), the rows every configuration must match."""
    return {name: rows_of(upstream["stack"], answers[0]) for name, answers in upstream["answers"].items()}


def expected_rows(prompt_tokens: int) -> int:
    return prompt_tokens + MAX_NEW - 1


def test_mirror_every_door_returns_inline_rows_and_a_pointer_to_the_same_rows(upstream, mirror):
    stack, ref = mirror["stack"], reference(upstream)
    for name, answers in mirror["answers"].items():
        assert answers[0]["inline"] is not None, name  # upstream's own payload stays in mirror mode
        inline = rows_of(stack, answers[0])
        assert np.array_equal(inline, ref[name]), name  # and equals the plugin-off server's
        assert inline.shape[1:] == (4, 2) and inline.shape[0] > MAX_NEW, name
        for i, answer in enumerate(answers):
            assert answer["url"] and answer["url"].startswith(stack.sidecar_url), (name, i)
            pointed = rows_of(stack, answer | {"inline": None})
            assert np.array_equal(pointed, inline), (name, i)  # greedy: every choice routed the same tokens


def assert_decodes_without_the_models_numbers(run: dict) -> None:
    """`RoutedExpertsRef.from_response(resp)[0].fetch()`, as the recipes write it, on every door's real response
    (a stream: its SSE chunks): the plugin put `routed_experts_shape` and `routed_experts_start_len` beside SGLang's
    flat string, in `meta_info` or in the chunk that carries it; a continuation's start is the one it asked for."""
    stack = run["stack"]
    for answers, start in ((run["answers"], 0), (run["continued"], START)):
        for name, (answer, *_) in answers.items():
            r = answer["bare"].fetch()
            assert r.array.shape[1:] == (stack.num_hidden_layers, stack.topk) and r.start == start, (name, start)
            assert np.array_equal(r.array, rows_of(stack, answer)), (name, start)
    for name, (answer, *_) in run["continued"].items():  # the continuation's rows are the whole run's from START
        assert_same_rows(f"{name} continued", rows_of(stack, run["answers"][name][0])[START:], rows_of(stack, answer))


def test_mirror_inline_rows_decode_without_the_models_numbers(mirror):
    assert_decodes_without_the_models_numbers(mirror)


def test_refs_of_every_door_fetch_the_same_rows(upstream, mirror, sidecar):
    """Contract 4 on the real server. Mirror: each door's first ref decodes SGLang's inline rows locally, upstream's
    rows (no request: mirror's server is stopped by now, the pool runs one stack at a time). Sidecar: `fetch_many`
    over every door's refs (one batch per sidecar) gives upstream's rows for the first choice and the pointer's for
    each choice."""
    ref_rows = reference(upstream)
    layers = mirror["stack"].num_hidden_layers
    for name, answers in mirror["answers"].items():
        assert answers[0]["ref"].inline is not None, name
        assert np.array_equal(answers[0]["ref"].fetch().to_sglang_layout(layers), ref_rows[name]), name
    stack = sidecar["stack"]
    for name, answers in sidecar["answers"].items():
        got = fetch_many([a["ref"] for a in answers], wait=30)
        assert np.array_equal(got[0].to_sglang_layout(layers), ref_rows[name]), name
        for i, (answer, r) in enumerate(zip(answers, got, strict=True)):
            assert np.array_equal(r.to_sglang_layout(layers), rows_of(stack, answer)), (name, i)


def test_sidecar_every_door_drops_inline_rows_and_points_to_the_plugin_off_rows(upstream, sidecar):
    ref = reference(upstream)
    stack = sidecar["stack"]
    for name, answers in sidecar["answers"].items():
        for i, answer in enumerate(answers):
            assert answer["inline"] is None, (name, i)  # the spool took them
            assert answer["url"] and answer["url"].startswith(stack.sidecar_url), (name, i, answer)
            assert np.array_equal(rows_of(stack, answer), ref[name]), (name, i)
    urls = [a["url"] for answers in sidecar["answers"].values() for a in answers]
    assert len(set(urls)) == len(urls)  # one record per request and per choice


def test_several_tokenizer_workers_keep_inline_rows_and_say_so(upstream, multi_tokenizer):
    ref = reference(upstream)
    stack = multi_tokenizer["stack"]
    for name, answers in multi_tokenizer["answers"].items():
        answer = answers[0]
        assert answer["url"] is None, name  # SGLang's tokenizer workers run no plugin: no pointer
        assert answer["inline"] is not None, name  # so the rows stay inline, never nothing
        assert np.array_equal(rows_of(stack, answer), ref[name]), name
    reports = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()["engines"]
    assert reports and all(r["delivery"]["mode"] == "mirror" for r in reports), reports
    assert all("--tokenizer-worker-num" in r["delivery"]["inline_kept"] for r in reports)
    assert all(r["delivery"]["configured_mode"] == "sidecar" for r in reports)
    assert stack.server.log_text().count("requests that ask for routed experts keep SGLang's inline payload") == 1
    rid = multi_tokenizer["answers"]["generate"][0]["rid"]
    meta, stored = stack.final_record(rid)  # the spool still has the record
    assert np.array_equal(stored.astype(np.int32), ref["generate"][:, list(meta.layers), :])


def test_several_tokenizer_workers_inline_rows_decode_without_the_models_numbers(multi_tokenizer):
    """SGLang loads no plugins in its tokenizer workers; the plugin has them import `http_worker`'s app
    (`SGLANG_HTTP_SERVER_APP_PATH`), whose hooks say the shape and start as the main process's do."""
    assert_decodes_without_the_models_numbers(multi_tokenizer)


def test_dp_controller_with_two_schedulers_points_to_the_plugin_off_rows(upstream, dp2):
    ref = reference(upstream)
    stack = dp2["stack"]
    for name, answers in dp2["answers"].items():
        for i, answer in enumerate(answers):
            assert answer["inline"] is None and answer["url"], (name, i, answer)
            assert np.array_equal(rows_of(stack, answer), ref[name]), (name, i)
    engines = {r["engine"] for r in httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()["engines"]}
    assert {e.rsplit("/", 1)[1] for e in engines} == {"dp0", "dp1"}, engines  # both schedulers ran the plugin


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import sglang

    def main():  # SGLang spawns its scheduler and detokenizer: this module is re-imported in them
        engine = sglang.Engine(
            model_path=sys.argv[1], load_format="auto", device="cpu", dtype="float32",
            enable_return_routed_experts=True, max_total_tokens=8192, max_running_requests=16,
            chunked_prefill_size=64, disable_cuda_graph=True, log_level="warning",
        )
        try:
            out = engine.generate(
                prompt=sys.argv[2], return_routed_experts=True,
                sampling_params={"max_new_tokens": int(sys.argv[3]), "temperature": 0.0, "ignore_eos": True},
            )
            print("R3RESULT " + json.dumps(out["meta_info"]), flush=True)
        finally:
            engine.shutdown()

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(600)
def test_offline_engine_returns_the_pointer(upstream, mirror, sglang_exclusive):
    """`sglang.Engine` in a process of its own (sidecar mode), with a sidecar on its spool; no server beside it."""
    root = sglang_exclusive() / "doors-engine"
    model_dir = write_tokenizer(write_model(root / "model"))
    spool = root / "spool"
    env = server_env(SIDECAR, spool)
    port = free_port()
    sidecar = spawn(
        [sys.executable, "-m", "service.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env | {"R3_TEST_SGLANG_CPU": "0"},
        root / "sidecar.log",
        f"http://127.0.0.1:{port}",
    )
    script = root / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    engine = spawn(
        [sys.executable, str(script), str(model_dir), PROMPT, str(MAX_NEW)],
        env | {"R3_SIDECAR_URL": sidecar.url},
        root / "engine.log",
        "",
    )
    try:
        sidecar.wait_http("/readyz", 60, "r3-sidecar")
        engine.proc.wait(400)
        text = engine.log_text()
        lines = [line for line in text.splitlines() if line.startswith("R3RESULT ")]
        assert engine.proc.returncode == 0 and lines, text[-3000:]
        meta = json.loads(lines[-1][len("R3RESULT ") :])
        assert "routed_experts" not in meta  # sidecar mode: the spool took the rows
        assert meta["routed_experts_url"].startswith(sidecar.url)
        rows = rows_of(mirror["stack"], {"inline": None, "url": meta["routed_experts_url"]})
        assert np.array_equal(rows, reference(upstream)["generate"])
    finally:
        engine.stop()
        sidecar.stop()


def test_capture_all_with_several_tokenizer_workers_is_refused_under_enforce(sglang_stack):
    with pytest.raises(RuntimeError) as failed:
        sglang_stack(REFUSED)
    message = str(failed.value)
    assert "exited with" in message
    assert "R3_CAPTURE_ALL=1 cannot deliver here" in message and "--tokenizer-worker-num 1" in message
