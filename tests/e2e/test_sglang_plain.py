"""A real SGLang 0.5.23 server, plugin off and on, the same requests in the same order.

Mirror mode: the plugin's records are SGLang's own inline payload byte for byte, and loading the plugin
changes nothing SGLang returns. Sidecar mode with `R3_CAPTURE_ALL=1`: every request has a record equal to
upstream's rows and a pointer, also those that did not ask. Spool full (a tiny `R3_SPOOL_MAX_BYTES`): every
request that asked still gets its rows, inline (and no pointer) when the spool refused them.

Covered per request: a short prompt; a prompt four prefill chunks long; `routed_experts_start_len > 0`;
a radix-cache prefix hit; a request that does not ask for routed experts; an abort mid-decode.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import sglang_abort
from baseline import spool_files
from docs_blocks import RECIPES
from prometheus_live import watching
from sglang_server import Config, Stack
from waiting import wait_until

from service.client import RoutedExpertsRef
from service.client.errors import SuspectRows

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # a server start counts in its first test

UPSTREAM = Config("plain-upstream", plugin=False, sidecar=False)
MIRROR = Config("plain-mirror", env={"R3_MODE": "mirror"})
# Issue 40: while this file exists, the CPU shim hands the capture zeros for layer ZERO_LAYER (test-only).
ZERO_FLAG = Path(tempfile.gettempdir()) / f"r3-zero-layer-{os.getpid()}"
ZERO_LAYER = 2
CAPTURE_ALL = Config(
    "plain-capture-all",
    env={"R3_MODE": "sidecar", "R3_CAPTURE_ALL": "1", "R3_TEST_ZERO_LAYER": f"{ZERO_LAYER}:{ZERO_FLAG}"},
)
SPOOL_FULL = Config(  # also the hook timers switched off
    "plain-spool-full", env={"R3_MODE": "sidecar", "R3_SPOOL_MAX_BYTES": "3000", "R3_HOOK_TIMERS": "0"}
)


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids inside the tiny model's vocabulary (256), different per seed."""
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


# name → (input_ids, extra request fields); sent one after another, in this order, to each configuration
REQUESTS: dict[str, tuple[list[int], dict]] = {
    "short": (prompt(6, 1), {}),
    "chunked": (prompt(200, 2), {}),  # 200 tokens at --chunked-prefill-size 64: four prefill chunks
    "start_len": (prompt(40, 3), {"routed_experts_start_len": 17}),
    "prefix_a": (prompt(90, 4), {}),
    "prefix_b": (prompt(90, 4) + prompt(30, 5), {}),  # 90 cached tokens from prefix_a
    "no_ask": (prompt(20, 6), {"return_routed_experts": False}),
}


def run_requests(stack: Stack) -> dict[str, dict]:
    out = {}
    for name, (ids, extra) in REQUESTS.items():
        body = {"return_routed_experts": True, "rid": f"{stack.config.name}-{name}"} | extra
        out[name] = stack.generate(ids, **body)
    return out


def abort_mid_decode(stack: Stack, rid: str, ids: list[int] | None = None, max_new_tokens: int = 1500) -> dict:
    """Start a long greedy decode, abort it once it has produced tokens, return SGLang's response."""
    return sglang_abort.abort_mid_decode(stack, rid, ids if ids is not None else prompt(30, 7), max_new_tokens)


@pytest.fixture(scope="module")
def upstream(sglang_stack) -> dict:
    stack = sglang_stack(UPSTREAM)
    return {"stack": stack, "responses": run_requests(stack), "aborted": abort_mid_decode(stack, "up-abort")}


@pytest.fixture(scope="module")
def mirror(upstream, sglang_stack) -> dict:
    stack = sglang_stack(MIRROR)
    return {"stack": stack, "responses": run_requests(stack), "aborted": abort_mid_decode(stack, "mirror-abort")}


@pytest.fixture(scope="module")
def resumed(mirror, sglang_stack) -> dict:
    """A partial rollout: abort mid-decode, resume with `routed_experts_start_len`; and the same uninterrupted."""
    stack = sglang_stack(MIRROR)
    ids, total = prompt(40, 8), 300  # the abort lands at the first decode line: after 40 decode steps at most
    params = {"max_new_tokens": total, "temperature": 0.0, "ignore_eos": True}
    whole = stack.generate(ids, rid="resume-whole", return_routed_experts=True, sampling_params=params, timeout=400)
    first = abort_mid_decode(stack, "resume-part-0", ids=ids, max_new_tokens=total)
    done = first["output_ids"]
    start = len(ids) + len(done) - 1  # the first row the aborted part does not hold
    rest = stack.generate(
        ids + done,
        rid="resume-part-1",
        return_routed_experts=True,
        routed_experts_start_len=start,
        sampling_params=params | {"max_new_tokens": total - len(done)},
        timeout=400,
    )
    return {"stack": stack, "whole": whole, "parts": (first, rest), "start": start}


@pytest.fixture(scope="module")
def capture_all(mirror, sglang_stack) -> dict:
    stack = sglang_stack(CAPTURE_ALL)
    return {"stack": stack, "responses": run_requests(stack)}


@pytest.fixture(scope="module")
def spool_full(capture_all, sglang_stack) -> dict:
    stack = sglang_stack(SPOOL_FULL)
    return {"stack": stack, "responses": run_requests(stack)}


def expected_rows(response: dict, start: int = 0) -> int:
    meta = response["meta_info"]
    return meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start


def test_upstream_returns_inline_rows_of_every_request_that_asks(upstream):
    stack, responses = upstream["stack"], upstream["responses"]
    for name, (_, extra) in REQUESTS.items():
        rows = stack.inline_rows(responses[name])
        if extra.get("return_routed_experts") is False:
            assert rows is None, name
            continue
        assert rows.shape == (expected_rows(responses[name], extra.get("routed_experts_start_len", 0)), 4, 2), name
        assert rows.min() >= 0 and rows.max() < 8, name
    assert responses["prefix_b"]["meta_info"]["cached_tokens"] >= 64  # the radix cache did serve a prefix


def test_the_model_routes_differently_per_layer_and_per_token(upstream):
    """The real weights make a layer mix-up visible: no two layers agree on most tokens, tokens vary."""
    rows = upstream["stack"].inline_rows(upstream["responses"]["chunked"])
    expert_sets = np.sort(rows, axis=2)  # a token's top-k as a set, per layer
    layers = expert_sets.shape[1]
    for a in range(layers):
        for b in range(a + 1, layers):
            same = np.all(expert_sets[:, a] == expert_sets[:, b], axis=1).mean()
            assert same < 0.5, (a, b, same)  # dummy weights: 1.0 for every pair
    assert len({row.tobytes() for row in expert_sets}) > rows.shape[0] // 2  # per token, too
    assert not np.array_equal(rows, rows[:, ::-1]), "reversed layers would read the same"


def test_a_baseline_proves_it_ran_without_the_plugin(upstream, mirror):
    """Every plugin-off reference is read through `baseline.assert_plugin_off` (an empty spool, no pointer). The same
    check on the mirror server's spool and answers, as if it were a baseline, names what the plugin left."""
    assert spool_files(upstream["stack"].spool) == []
    assert all("routed_experts_url" not in r["meta_info"] for r in upstream["responses"].values())
    posing = dataclasses.replace(mirror["stack"], config=dataclasses.replace(MIRROR, plugin=False))
    with pytest.raises(AssertionError, match="is a plugin-off baseline, yet the plugin left") as left:
        posing.assert_plugin_off({})
    assert "v1/engines/" in str(left.value)  # its engine file
    with pytest.raises(AssertionError, match="routed_experts_url"):
        dataclasses.replace(posing, spool=upstream["stack"].spool).assert_plugin_off(
            mirror["responses"]["chunked"]["meta_info"]
        )


def test_loading_the_plugin_changes_nothing_sglang_returns(upstream, mirror):
    for name in REQUESTS:
        up, on = upstream["responses"][name], mirror["responses"][name]
        assert on["output_ids"] == up["output_ids"], name
        assert on["meta_info"].get("routed_experts") == up["meta_info"].get("routed_experts"), name


def test_mirror_records_equal_sglang_inline_payload_byte_for_byte(mirror):
    stack, responses = mirror["stack"], mirror["responses"]
    with httpx.Client(base_url=stack.sidecar_url, timeout=30) as sidecar:
        for name, (ids, extra) in REQUESTS.items():
            if extra.get("return_routed_experts") is False:
                continue
            rid, response = f"{stack.config.name}-{name}", responses[name]
            inline = stack.inline_rows(response)
            b64 = sidecar.get(f"/routed_experts/{rid}", params={"format": "sglang_b64", "wait": 10})
            assert b64.status_code == 200, (name, b64.text)
            assert b64.text == response["meta_info"]["routed_experts"], name  # SGLang's own bytes
            meta, stored = stack.final_record(rid)
            assert (meta.final, meta.status, meta.prompt_len) == (True, "ok", len(ids)), name
            assert meta.start == extra.get("routed_experts_start_len", 0), name
            assert np.array_equal(stored.astype(np.int32), inline[:, list(meta.layers), :]), name


def test_the_pointer_in_meta_info_names_the_record(mirror):
    stack = mirror["stack"]
    response = mirror["responses"]["chunked"]
    url = response["meta_info"]["routed_experts_url"]
    assert url.startswith(stack.sidecar_url)
    fetched = httpx.get(url, params={"format": "sglang_b64"}, timeout=30)
    assert fetched.text == response["meta_info"]["routed_experts"]
    assert "routed_experts_url" not in mirror["responses"]["no_ask"]["meta_info"]


def test_a_request_that_does_not_ask_leaves_no_record(mirror):
    stack = mirror["stack"]
    rid = f"{stack.config.name}-no_ask"
    stack.final_record("mirror-abort")  # the writer has published what came after this request
    assert stack.record(rid) == (None, None)
    assert httpx.get(f"{stack.sidecar_url}/routed_experts/{rid}", timeout=10).status_code == 404


def test_abort_mid_decode_keeps_the_rows_so_far(upstream, mirror):
    for side in (upstream, mirror):
        response = side["aborted"]
        assert response["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < response["meta_info"]["completion_tokens"] < 1500
        inline = side["stack"].inline_rows(response)
        assert inline.shape[0] == expected_rows(response)  # SGLang returns an aborted request's rows inline
    meta, stored = mirror["stack"].final_record("mirror-abort")
    assert (meta.final, meta.status) == (True, "aborted")
    inline = mirror["stack"].inline_rows(mirror["aborted"])
    assert np.array_equal(stored.astype(np.int32), inline)


def test_a_resumed_partial_rollout_splices_into_the_uninterrupted_rows(resumed):
    """Abort on weight update, resume with `routed_experts_start_len`, fetch each part with `start=`."""
    stack, start = resumed["stack"], resumed["start"]
    first, rest = resumed["parts"]
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(first["output_ids"]) < len(resumed["whole"]["output_ids"])
    assert first["output_ids"] + rest["output_ids"] == resumed["whole"]["output_ids"]  # greedy: same tokens
    with httpx.Client(base_url=stack.sidecar_url, timeout=30) as sidecar:
        head = sidecar.get("/routed_experts/resume-part-0", params={"format": "raw", "end": start, "wait": 10})
        tail = sidecar.get("/routed_experts/resume-part-1", params={"format": "raw", "start": start, "wait": 10})
        whole = sidecar.get("/routed_experts/resume-whole", params={"format": "raw", "wait": 10})
    assert (head.status_code, tail.status_code, whole.status_code) == (200, 200, 200)
    assert head.headers["X-R3-Status"] == "aborted"
    dtype = whole.headers["X-R3-Dtype"]
    spliced = np.concatenate([np.frombuffer(head.content, dtype), np.frombuffer(tail.content, dtype)])
    expected = stack.inline_rows(resumed["whole"]).astype(dtype).reshape(-1)
    assert np.array_equal(np.frombuffer(whole.content, dtype), expected)
    assert np.array_equal(spliced, expected)


def test_capture_all_records_every_request_as_upstream_routed_it(upstream, capture_all):
    stack = capture_all["stack"]
    for name in REQUESTS:
        rid, response = f"{stack.config.name}-{name}", capture_all["responses"][name]
        assert "routed_experts" not in response["meta_info"], name  # sidecar mode: the spool took the rows
        fetched = httpx.get(response["meta_info"]["routed_experts_url"], params={"format": "npy"}, timeout=30)
        assert fetched.status_code == 200, (name, fetched.text)
        meta, stored = stack.final_record(rid)
        reference = upstream["responses"][name]["meta_info"].get("routed_experts")
        if reference is None:  # upstream did not capture it: compare with the plain server's own rows count
            assert meta.rows == expected_rows(response), name
            continue
        rows = upstream["stack"].inline_rows(upstream["responses"][name])
        assert np.array_equal(stored.astype(np.int32), rows[:, list(meta.layers), :]), name


def _engine_reports(stack: Stack) -> list[dict]:
    body = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()
    return body if isinstance(body, list) else body.get("engines", [])


def _settled_engine_file(stack: Stack, key: str = "writer") -> dict:
    """The engine file once two consecutive writes agree on `key` (the server is idle after the requests)."""
    last: dict | None = None

    def settled() -> dict | None:
        nonlocal last
        (report,) = _engine_reports(stack)
        seen, last = last, report
        agree = seen is not None and report["updated"] != seen["updated"] and report.get(key) == seen.get(key)
        return report if agree else None

    return wait_until(settled, 20, lambda: f"engine file {key} settled (last: {last})", interval=0.6)


def test_hook_timers_count_every_hook_per_forward_kind_in_the_engine_file_and_metrics(capture_all):
    stack = capture_all["stack"]
    hooks = _settled_engine_file(stack, "hooks")["hooks"]
    for hook in ("forward_extent", "forward_end", "batch_result"):
        for kind in ("extend", "decode"):
            assert hooks[hook][kind]["calls"] > 0 and hooks[hook][kind]["seconds"] > 0, (hook, kind, hooks)
    assert "device_capture" not in hooks  # the per-layer hook runs inside the (compilable) forward: untimed
    assert sum(t["calls"] for t in hooks["collect"].values()) >= len(REQUESTS)  # once per finished request
    text = httpx.get(f"{stack.sidecar_url}/metrics", timeout=10).text
    engine = _engine_reports(stack)[0]["engine"]
    for name in ("r3_engine_hook_seconds_total", "r3_engine_hook_calls_total"):
        sample = f'{name}{{engine="{engine}",hook="forward_extent",kind="decode"}} '
        line = next((ln for ln in text.splitlines() if ln.startswith(sample)), None)
        assert line is not None and float(line.split()[-1]) > 0, (sample, text[-2000:])


def test_a_capture_that_writes_zeros_for_one_layer_leaves_a_suspect_record(capture_all, tmp_path):
    """Issue 40 on a real server: the capture of one layer says "expert 0" for every token (as a kernel that
    routes inside itself leaves it). The record is kept and marked at its first row and that layer, the sidecar
    refuses it unless asked, the trainer client raises, the engine file and /metrics count it, and a real
    Prometheus scraping this sidecar with the shipped rules fires `R3SuspectRecords` for this engine (quiet
    before); no other record of this server (true routes) is suspect."""
    stack = capture_all["stack"]
    rid = f"{stack.config.name}-zeroed"
    with watching(stack.sidecar_url, tmp_path / "prometheus") as prom:
        wait_until(lambda: prom.query("r3_engine_suspect_records_total == 0"), 60, "a scrape counting 0 suspect")
        assert not prom.firing("R3SuspectRecords"), prom.active_alerts()
        ZERO_FLAG.touch()
        try:
            response = stack.generate(prompt(30, 9), rid=rid, return_routed_experts=True)
        finally:
            ZERO_FLAG.unlink()
        engine = _engine_reports(stack)[0]["engine"]
        wait_until(lambda: prom.firing("R3SuspectRecords"), 60, "R3SuspectRecords firing in Prometheus")
        assert [a["engine"] for a in prom.firing("R3SuspectRecords")] == [engine], prom.active_alerts()
    meta, stored = stack.final_record(rid)
    assert meta.status == "suspect" and (meta.suspect.row, meta.suspect.layer) == (0, ZERO_LAYER), meta
    assert meta.suspect.reason == "repeated" and not stored[:, meta.layers.index(ZERO_LAYER)].any()
    fetched = httpx.get(response["meta_info"]["routed_experts_url"], timeout=30)
    assert fetched.status_code == 422 and fetched.json()["error"] == "record_suspect", fetched.text
    (ref,) = RoutedExpertsRef.from_response(response)
    with pytest.raises(SuspectRows, match=f"row 0, layer {ZERO_LAYER}: repeated"):
        ref.fetch()
    assert ref.fetch(allow_suspect=True).rows == meta.rows
    wait_until(
        lambda: any(r["writer"].get("suspect_records") == 1 for r in _engine_reports(stack)),
        30,
        "the engine file counting one suspect record",
    )
    text = httpx.get(f"{stack.sidecar_url}/metrics", timeout=10).text
    assert f'r3_engine_suspect_records_total{{engine="{engine}"}} 1.0' in text, text[-3000:]
    assert 'r3_records{state="suspect"} 1.0' in text
    for name in REQUESTS:
        assert stack.record(f"{stack.config.name}-{name}")[0].status != "suspect", name


def test_spool_full_every_request_that_asked_gets_its_rows(upstream, spool_full):
    stack = spool_full["stack"]
    inline, pointed = [], []
    for name, (_, extra) in REQUESTS.items():
        if extra.get("return_routed_experts") is False:
            continue
        response, reference = spool_full["responses"][name], upstream["responses"][name]
        rows = upstream["stack"].inline_rows(reference)
        if "routed_experts" in response["meta_info"]:  # the spool refused it: SGLang's own payload stays
            assert response["meta_info"]["routed_experts"] == reference["meta_info"]["routed_experts"], name
            assert "routed_experts_url" not in response["meta_info"], name  # no pointer that could only 404
            inline.append(name)
        else:
            assert response["meta_info"]["routed_experts_url"].startswith(stack.sidecar_url), name
            meta, stored = stack.final_record(f"{stack.config.name}-{name}")
            assert np.array_equal(stored.astype(np.int32), rows[:, list(meta.layers), :]), name
            pointed.append(name)
    assert inline and pointed, (inline, pointed)  # the budget took some records and refused others
    for name in inline:  # a held rid (or mirror mode's pointer) to refused rows: 410 at once, not a 30 s wait
        began = time.monotonic()
        answer = httpx.get(f"{stack.sidecar_url}/routed_experts/{stack.config.name}-{name}?wait=30", timeout=40)
        assert answer.status_code == 410 and answer.json()["error"] == "record_error", (name, answer.text)
        assert "did not reach the spool" in answer.json()["detail"] and time.monotonic() - began < 10, name

    def counted() -> int:  # the engine file is rewritten about once a second
        engine = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()
        reports = engine if isinstance(engine, list) else engine.get("engines", [])
        n = sum(r["writer"]["fallback_inline"] for r in reports)
        return n if n >= len(inline) else 0

    assert wait_until(counted, 15, f"{len(inline)} inline fallbacks counted", interval=0.5) == len(inline)


def test_hook_timers_switched_off_leave_no_hooks_and_no_hook_metrics(spool_full):
    stack = spool_full["stack"]
    report = _settled_engine_file(stack)
    assert "hooks" not in report, report
    assert "r3_engine_hook_seconds_total{" not in httpx.get(f"{stack.sidecar_url}/metrics", timeout=10).text


# Last: these read the mirror and spool-full responses together, and starting spool_full's server stops mirror's,
# which the tests above still talk to.
def test_inline_rows_say_their_shape_and_start(upstream, mirror, spool_full):
    """Wherever the plugin hands rows inline (mirror mode; a refused spool in sidecar mode), meta_info says their
    shape and start, so `from_response(resp)[0].fetch()` decodes them without the model's numbers, and a
    continuation (`routed_experts_start_len=17`) starts at 17: `fetch(start=17)` as slime writes it."""
    assert all("routed_experts_shape" not in r["meta_info"] for r in upstream["responses"].values())  # no plugin
    seen = []
    for side in (mirror, spool_full):
        stack = side["stack"]
        for name, (_, extra) in REQUESTS.items():
            response = side["responses"][name]
            meta = response["meta_info"]
            if "routed_experts" not in meta:
                assert "routed_experts_shape" not in meta, name
                continue
            start = extra.get("routed_experts_start_len", 0)
            inline = stack.inline_rows(response)
            assert meta["routed_experts_shape"] == [len(inline), stack.num_hidden_layers, stack.topk], name
            assert meta["routed_experts_start_len"] == start and len(inline) == expected_rows(response, start), name
            r = RoutedExpertsRef.from_response(response)[0].fetch(start=start)
            assert (r.start, r.rows) == (start, len(inline)) and np.array_equal(r.array, inline), name
            seen.append((stack.config.name, name))
    assert ("plain-mirror", "start_len") in seen and any(side == "plain-spool-full" for side, _ in seen), seen


@pytest.mark.parametrize("block", RECIPES, ids=[b.id for b in RECIPES])
def test_the_docs_recipes_run_on_every_delivery_mode(block, mirror, spool_full):
    """Each recipe of README.md and docs/ (`tests/docs_blocks.py`) with its stand-in replaced by this server's own
    responses: both rows and pointer (mirror: decoded here, its server stopped by now), the pointer only and the
    rows only (sidecar mode with a small spool: the records it took, and those it refused)."""
    asked = [r for n, r in spool_full["responses"].items() if n != "no_ask"]
    responses = {
        "both": mirror["responses"]["start_len"],
        "pointer": next(r for r in asked if "routed_experts" not in r["meta_info"]),
        "inline": next(r for r in asked if "routed_experts" in r["meta_info"]),
    }
    assert "routed_experts" not in responses["pointer"]["meta_info"]
    assert "routed_experts_url" not in responses["inline"]["meta_info"]
    for mode, response in responses.items():
        source = block.with_response("__response__")
        exec(compile(source, f"{block.id}[{mode}]", "exec"), {"__name__": "__docs__", "__response__": response})
