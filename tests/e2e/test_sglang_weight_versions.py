"""Weight versions on a real SGLang 0.5.23 server: records carry the version SGLang serves under.

Launched with `--weight-version v0`, mirror mode (SGLang's inline rows and its own `meta_info` spans beside
each record). An update between requests (`/update_weight_version`, SGLang's endpoint for a version change
without new weights; `update_weights_from_*` take the same path in the scheduler, `record_weight_version_change`)
changes the next record's version. A request that spans an update (one that does not abort the running
requests, `abort_all_requests: false`) records the position where the version
changed, the same boundary as SGLang's own `meta_info["weight_versions"]` (spans over output tokens), on
both delivery paths (finish-time and live rows), and the sidecar serves it in headers and frames.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest
from sglang_server import Config, Stack
from waiting import wait_until

from service.client import RoutedExpertsClient, RoutedExpertsRef

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

VERSIONED = Config("weight-versions", args={"weight-version": "v0"}, env={"R3_MODE": "mirror"})


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def set_version(stack: Stack, version: str, *, abort_all: bool = True) -> None:
    """SGLang's endpoint aborts every running request first unless told not to (`abort_all_requests`)."""
    body = {"new_version": version, "abort_all_requests": abort_all}
    response = httpx.post(f"{stack.url}/update_weight_version", json=body, timeout=30)
    response.raise_for_status()
    assert response.json()["success"], response.text


def expected_positions(spans: list[dict], prompt_len: int) -> list[list]:
    """SGLang's output-token spans as the positions of the rows each version routed (`sglang/weight_versions.py`)."""
    return [[0 if s["start"] == 0 else prompt_len + s["start"] - 1, s["version"]] for s in spans]


@pytest.fixture(scope="module")
def stack(sglang_stack) -> Stack:
    return sglang_stack(VERSIONED)


def test_update_between_requests_changes_the_recorded_version(stack: Stack) -> None:
    body = {"return_routed_experts": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    first = stack.generate(prompt(12, 1), rid="wv-before", **body)
    set_version(stack, "v1")
    second = stack.generate(prompt(12, 2), rid="wv-after", **body)
    assert first["meta_info"]["weight_version"] == "v0" and second["meta_info"]["weight_version"] == "v1"
    before, _ = stack.final_record("wv-before")
    after, _ = stack.final_record("wv-after")
    assert (before.weight_version, before.weight_versions) == ("v0", ())
    assert (after.weight_version, after.weight_versions) == ("v1", ())
    with RoutedExpertsClient(stack.sidecar_url) as client:
        got = client.get("wv-after")
        assert (got.weight_version, got.weight_versions) == ("v1", ())
        (framed,) = client.get_many(["wv-before"])
        assert framed.weight_version == "v0"


def decode_across_update(stack: Stack, tag: str, version: str, *, abort_all: bool) -> dict[str, tuple[list, dict]]:
    """Two requests decode while the version changes, one delivered at finish, one as live rows; by rid, its
    prompt and SGLang's response. They go as one batch, so both run before the update: sent apart, the
    finish-time one reached the scheduler after the update once on a loaded machine (one span, not two)."""
    rids = [f"wv-{tag}", f"wv-{tag}-live"]
    ids = {rids[0]: prompt(20, 3), rids[1]: prompt(24, 4)}
    params = [
        {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True, "custom_params": {"r3_live_rows": live}}
        for live in (False, True)
    ]
    body = {"input_ids": [ids[r] for r in rids], "sampling_params": params, "return_routed_experts": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{stack.url}/generate", json=body | {"rid": rids}, timeout=300)

        def decoding() -> bool:  # both requests are decoding: the live record has rows past its prompt
            meta, _ = stack.record(rids[1])
            return meta is not None and meta.end > len(ids[rids[1]]) + 5

        wait_until(decoding, 120, f"{rids[1]} decoding (its live record 5 rows past the prompt)")
        set_version(stack, version, abort_all=abort_all)
        responses = pending.result(timeout=300).json()
    return {rid: (ids[rid], response) for rid, response in zip(rids, responses, strict=True)}


def test_a_request_spanning_an_update_records_where_the_version_changed(stack: Stack) -> None:
    """An update that lets the running requests decode on: both records say where the version changed."""
    with RoutedExpertsClient(stack.sidecar_url) as client:
        for rid, (ids, response) in decode_across_update(stack, "span", "v2", abort_all=False).items():
            spans = response["meta_info"]["weight_versions"]
            assert response["meta_info"]["finish_reason"]["type"] == "length", response["meta_info"]  # decoded on
            assert len(spans) == 2 and spans[-1]["version"] == "v2", spans  # SGLang's own account: it spanned
            meta, rows = stack.final_record(rid)
            want = expected_positions(spans, len(ids))
            assert meta.weight_version == "v2"
            assert [list(p) for p in meta.weight_versions] == want
            assert 0 < want[1][0] < meta.end
            inline = stack.inline_rows(response)
            np.testing.assert_array_equal(rows, inline[:, list(meta.layers)])  # the rows themselves are SGLang's
            shape = {"num_hidden_layers": meta.num_hidden_layers, "topk": rows.shape[2]}  # to shape SGLang's flat rows
            (ref,) = RoutedExpertsRef.from_response(response, **shape)
            assert ref.weight_version == "v2" and ref.fetch().weight_version == "v2"  # the ref names it too
            served = client.get(rid)
            assert served.weight_version == "v2"
            assert [list(p) for p in served.weight_versions] == want
            (framed,) = client.get_many([rid])
            assert [list(p) for p in framed.weight_versions] == want


def test_an_update_that_aborts_the_running_requests_records_what_sglang_reports(stack: Stack) -> None:
    """SGLang's default update aborts every running request first, and a request can finish before the change
    is recorded (one span, the old version) or after it (two spans): each record says what SGLang's own
    `meta_info` says, either way."""
    for rid, (ids, response) in decode_across_update(stack, "aborted", "v3", abort_all=True).items():
        spans = response["meta_info"]["weight_versions"]
        assert response["meta_info"]["finish_reason"]["type"] == "abort", response["meta_info"]
        meta, rows = stack.final_record(rid)
        assert meta.status == "aborted" and meta.weight_version == spans[-1]["version"], (spans, meta)
        want = expected_positions(spans, len(ids)) if len(spans) > 1 else []
        assert [list(p) for p in meta.weight_versions] == want
        np.testing.assert_array_equal(rows, stack.inline_rows(response)[:, list(meta.layers)])
