"""The real-server smoke suite every older SGLang of the support matrix runs: one body, one module per version.

A thin module (`test_sglang_0_5_20.py`, …) sets `VERSION` and imports this module's tests and fixtures; the
servers run that version's venv (`.venv-sglang-<VERSION>`, skipped with the reason when it is missing).
Four module-scoped servers, one after another: upstream (plugin off), mirror, sidecar mode, and a dense+MoE
model (GLM-4.5's layout, layer 0 dense) in mirror mode. What is proven per version: the plugin's hooks run
there (records, pointer, engine file naming that version), the records are that version's own inline
payload byte for byte (mirror: the same response's; sidecar: the upstream server's rows for the same request),
loading the plugin changes nothing SGLang returns, an abort keeps its rows, and a resumed partial rollout
splices into the uninterrupted one. Few prompts: CI runs this per version (docs/versions.md). The servers'
configurations and requests, and the readers of what a server answered, are `version_servers.py`'s.
"""

from __future__ import annotations

import base64
import dataclasses

import httpx
import numpy as np
import pytest
from baseline import assert_same_rows
from sglang_abort import abort_mid_decode
from test_sglang_front_doors import CONTINUATIONS, assert_decodes_without_the_models_numbers, knock
from version_servers import (
    NOT_DELIVERED,
    REQUESTS,
    assert_same_answer,
    configs,
    engine_report,
    expected_rows,
    prompt,
    run_requests,
    wait_agreed,
)
from waiting import wait_until

from engine_ext.core.settings import EngineSettings
from engine_ext.sglang.versions import RELEASES, support
from service.client import RoutedExpertsRef, trainers

# Tests run in this file's order and the pool keeps one server: each server's tests come before the next's.


@pytest.fixture(scope="module")
def version(request) -> str:
    return request.module.VERSION


@pytest.fixture(scope="module")
def upstream(version, sglang_stack) -> dict:
    stack = sglang_stack(configs(version)["upstream"])
    return {"stack": stack, "responses": run_requests(stack)}


@pytest.fixture(scope="module")
def mirror(version, upstream, sglang_stack) -> dict:
    """Mirror mode: the requests, an abort, and a partial rollout aborted and resumed next to the whole one."""
    stack = sglang_stack(configs(version)["mirror"])
    out = {"stack": stack, "responses": run_requests(stack)}
    out["aborted"] = abort_mid_decode(stack, f"{stack.config.name}-abort", prompt(30, 7), 1500)
    # The aborted part first (however far it got), then the uninterrupted run and the resume to the same length.
    ids, more = prompt(40, 8), 40
    params = {"temperature": 0.0, "ignore_eos": True}
    first = abort_mid_decode(stack, "resume-part-0", ids, 1500)
    done = first["output_ids"]
    out["whole"] = stack.generate(
        ids,
        rid="resume-whole",
        return_routed_experts=True,
        sampling_params=params | {"max_new_tokens": len(done) + more},
    )
    start = len(ids) + len(done) - 1  # the first row the aborted part does not hold
    rest = stack.generate(
        ids + done,
        rid="resume-part-1",
        return_routed_experts=True,
        routed_experts_start_len=start,
        sampling_params=params | {"max_new_tokens": more},
    )
    return out | {"parts": (first, rest), "start": start}


@pytest.fixture(scope="module")
def sidecar(version, mirror, sglang_stack) -> dict:
    """Sidecar mode. On a release no test proved, the plugin keeps SGLang's inline rows until its first records
    agree with them (`build_check`): those records come first, so the suite's requests meet sidecar delivery."""
    stack = sglang_stack(configs(version)["sidecar"])
    if not support(version, RELEASES[version]).proven:
        for i in range(EngineSettings.model_fields["build_check_records"].default):  # the servers set none
            stack.generate(prompt(12, 40 + i), return_routed_experts=True, rid=f"{stack.config.name}-check-{i}")
        wait_agreed(stack)
    return {"stack": stack, "responses": run_requests(stack)}


@pytest.fixture(scope="module")
def dense(version, sidecar, sglang_stack) -> dict:
    stack = sglang_stack(configs(version)["dense"])
    responses = {
        n: stack.generate(prompt(n, n), rid=f"{stack.config.name}-{n}", return_routed_experts=True) for n in (2, 90)
    }
    return {"stack": stack, "responses": responses}


def test_upstream_rows_route_differently_per_layer(upstream):
    stack, responses = upstream["stack"], upstream["responses"]
    for name, (_, extra) in REQUESTS.items():
        rows = stack.inline_rows(responses[name])
        assert rows.shape == (expected_rows(responses[name], extra.get("routed_experts_start_len", 0)), 4, 2), name
    sets = np.sort(stack.inline_rows(responses["chunked"]), axis=2)
    for b in range(1, sets.shape[1]):  # the seeded weights: a layer mix-up would show
        assert np.all(sets[:, 0] == sets[:, b], axis=1).mean() < 0.5, b


def test_the_plugin_runs_on_this_version_and_names_it(version, mirror):
    """The start-up line names the build, the layout applied and whether a test proved it (INFO when proven, seen
    even before SGLang configured its logging; a WARNING when it only fits); an unproven build's engine file's
    self-check says `agreed` once its first records equal SGLang's own inline rows (`build_check`)."""
    stack = mirror["stack"]
    log = stack.server.log_text()
    plan = support(version, RELEASES[version])
    assert "registering no hooks" not in log and "r3-sidecar: hook" not in log
    assert plan.describe() in log, log[-3000:]
    report = engine_report(stack)
    assert report["sglang"] == version
    assert (report["build"]["layout"], report["build"]["proven"]) == (RELEASES[version], plan.proven)
    if not plan.proven:
        wait_agreed(stack)
    assert mirror["responses"]["chunked"]["meta_info"]["routed_experts_url"].startswith(stack.sidecar_url)


def test_loading_the_plugin_changes_nothing_sglang_returns(upstream, mirror):
    for name in REQUESTS:
        up, on = upstream["responses"][name], mirror["responses"][name]
        assert_same_answer(name, upstream["stack"], up, on)


def test_mirror_records_are_the_inline_payload_byte_for_byte(mirror):
    stack = mirror["stack"]
    with httpx.Client(base_url=stack.sidecar_url, timeout=30) as client:
        for name, (ids, extra) in REQUESTS.items():
            rid, response = f"{stack.config.name}-{name}", mirror["responses"][name]
            served = client.get(f"/routed_experts/{rid}", params={"format": "sglang_b64", "wait": 10})
            assert served.status_code == 200, (name, served.text)
            assert served.text == response["meta_info"]["routed_experts"], name
            meta, stored = stack.final_record(rid)
            start = extra.get("routed_experts_start_len", 0)
            assert (meta.status, meta.prompt_len, meta.start) == ("ok", len(ids), start), name
            assert np.array_equal(stored.astype(np.int32), stack.inline_rows(response)), name
    assert stack.suspect_rids() == []  # issue 40: every record of true routes passes the row check


def test_abort_mid_decode_keeps_the_rows_so_far(mirror):
    stack, response = mirror["stack"], mirror["aborted"]
    assert response["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < response["meta_info"]["completion_tokens"] < 1500
    inline = stack.inline_rows(response)
    assert inline.shape[0] == expected_rows(response)
    meta, stored = stack.final_record(f"{stack.config.name}-abort")
    assert (meta.final, meta.status) == (True, "aborted")
    assert np.array_equal(stored.astype(np.int32), inline)


def test_a_resumed_partial_rollout_splices_from_sglang_own_parts(mirror):
    """Abort, resume with `routed_experts_start_len`, fetch each part with `start=`/`end=`: SGLang's own rows.

    The splice is compared with the parts' inline payloads, and the aborted part with the uninterrupted run.
    The resumed part's first row is that token's prefill over the cached prefix, not a decode step: on 0.5.16
    SGLang's own payload routes it differently in one layer from the uninterrupted run (bf16), so comparing the
    resumed part with the uninterrupted run would test SGLang's numerics, not the plugin.
    """
    stack, start = mirror["stack"], mirror["start"]
    (first, rest), whole = mirror["parts"], mirror["whole"]
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(first["output_ids"]) < 1500
    assert first["output_ids"] + rest["output_ids"] == whole["output_ids"]  # greedy: the same tokens
    head_rows, tail_rows = stack.inline_rows(first), stack.inline_rows(rest)
    assert np.array_equal(head_rows, stack.inline_rows(whole)[: len(head_rows)])
    with httpx.Client(base_url=stack.sidecar_url, timeout=30) as client:
        head = client.get("/routed_experts/resume-part-0", params={"format": "raw", "end": start, "wait": 10})
        tail = client.get("/routed_experts/resume-part-1", params={"format": "raw", "start": start, "wait": 10})
    assert (head.status_code, tail.status_code) == (200, 200)
    assert head.headers["X-R3-Status"] == "aborted"
    dtype = head.headers["X-R3-Dtype"]
    spliced = np.concatenate([np.frombuffer(head.content, dtype), np.frombuffer(tail.content, dtype)])
    assert np.array_equal(spliced, np.concatenate([head_rows[:start], tail_rows]).astype(dtype).reshape(-1))


def test_the_trainer_line_decodes_every_delivery_mode_without_the_models_numbers(upstream, mirror, sidecar):
    """The line of docs/trainers/verl.md on this version (verl 0.9.1 pins 0.5.12): `from_response(resp)[0]` with no
    model numbers, then `trainers.verl`, gives upstream's rows, from mirror's inline rows (which say their shape
    and start, a continuation's included) and through sidecar mode's pointer."""
    for name, (_, extra) in REQUESTS.items():
        start = extra.get("routed_experts_start_len", 0)
        want = upstream["stack"].inline_rows(upstream["responses"][name])
        for side in (mirror, sidecar):
            response = side["responses"][name]
            if "routed_experts" in response["meta_info"]:
                assert response["meta_info"]["routed_experts_shape"] == list(want.shape), name
                assert response["meta_info"]["routed_experts_start_len"] == start, name
            r = RoutedExpertsRef.from_response(response)[0].fetch(start=start, wait=30)
            got = trainers.verl(r, side["stack"].num_hidden_layers)
            assert got.dtype == np.int32 and np.array_equal(got, want), (side["stack"].config.name, name)


def test_sidecar_serves_its_records_in_sglang_bytes_and_they_are_upstream_rows(upstream, sidecar):
    """Sidecar mode's answer has no inline rows: its pointer serves the record's rows in SGLang's own base64
    bytes, and the record holds the plugin-off server's rows for the same request."""
    stack = sidecar["stack"]
    for name in REQUESTS:
        response, reference = sidecar["responses"][name], upstream["responses"][name]
        assert "routed_experts" not in response["meta_info"], name  # the spool took the rows
        assert response["output_ids"] == reference["output_ids"], name
        served = httpx.get(response["meta_info"]["routed_experts_url"], params={"format": "sglang_b64", "wait": 10})
        assert served.status_code == 200, (name, served.text)
        meta, stored = stack.final_record(f"{stack.config.name}-{name}")
        assert meta.status == "ok", name
        assert served.text == base64.b64encode(stored.astype(np.int32).tobytes()).decode(), name  # the record's bytes
        assert_same_rows(name, upstream["stack"].inline_rows(reference), stored.astype(np.int32))  # upstream's
    assert stack.suspect_rids() == []  # issue 40: every record of true routes passes the row check


@pytest.mark.matrix  # a fourth server start per release: CI proves the dense+MoE layout on 0.5.23 (test_sglang_limits)
def test_dense_and_moe_layers_records_hold_the_moe_layers_and_serve_sglang_bytes(dense):
    stack = dense["stack"]
    for n, response in dense["responses"].items():
        rid, inline = f"{stack.config.name}-{n}", stack.inline_rows(response)
        assert inline.shape == (n + 8 - 1, 3, 2) and not inline[:, 0, :].any()  # layer 0 is dense: a zero slot
        meta, stored = stack.final_record(rid)
        assert (meta.layers, meta.num_hidden_layers) == ((1, 2), 3)
        assert np.array_equal(stored.astype(np.int32), inline[:, [1, 2], :])
        served = httpx.get(f"{stack.sidecar_url}/routed_experts/{rid}", params={"format": "sglang_b64"}, timeout=30)
        assert served.text == response["meta_info"]["routed_experts"]  # byte for byte, dense slot included


@pytest.fixture(scope="module")
def workers(version, upstream, sglang_stack) -> dict:
    """`--tokenizer-worker-num 2`, mirror mode: the suite's requests and every front door, continuations too."""
    stack = sglang_stack(configs(version)["workers"])
    return {
        "stack": stack,
        "responses": run_requests(stack),
        "answers": knock(stack),
        "continued": knock(stack, CONTINUATIONS),
    }


def test_several_tokenizer_workers_inline_rows_decode_without_the_models_numbers(workers):
    """SGLang ≤ 0.5.20 hands its workers' app path to `uvicorn.run` as a literal; the plugin, in the main process,
    has the workers import `http_worker`'s app instead (`engine_ext/sglang/worker_app.py`), whose hooks put the
    shape and start beside SGLang's flat string: every door's `from_response(resp)[0].fetch()` decodes it, with
    no model numbers, to SGLang's payload byte for byte; a continuation's too, from where it asked."""
    stack = workers["stack"]
    log = stack.server.log_text()
    assert "tokenizer workers serve engine_ext.sglang.http_worker:app" in log
    assert "r3-sidecar: hook" not in log  # no guard stepped aside (`guard.Guard.trip`'s line)
    assert NOT_DELIVERED not in log, log[log.find(NOT_DELIVERED) - 200 :][:600]  # e.g. `n=2`'s prefix request
    assert_decodes_without_the_models_numbers(workers)
    for answers in (workers["answers"], workers["continued"]):
        for name, (answer, *_) in answers.items():
            assert answer["url"] is None and answer["inline"] is not None, name  # no pointer from a worker
            rows = answer["bare"].fetch().array
            assert rows.dtype == np.int32 and rows.tobytes() == base64.b64decode(answer["inline"]), name


def test_several_tokenizer_workers_change_nothing_sglang_returns(upstream, workers):
    """The same `input_ids` requests as upstream's server (plugin off, one tokenizer process): the same tokens,
    SGLang's inline payload byte for byte, and its shape and start stated beside it; the spool has the record."""
    stack = workers["stack"]
    for name, (_, extra) in REQUESTS.items():
        up, on = upstream["responses"][name], workers["responses"][name]
        assert_same_answer(name, upstream["stack"], up, on)
        want = stack.inline_rows(on)  # the plugin-off server's rows: checked just above
        start = extra.get("routed_experts_start_len", 0)
        assert on["meta_info"]["routed_experts_shape"] == list(want.shape), name
        assert on["meta_info"]["routed_experts_start_len"] == start, name
        r = RoutedExpertsRef.from_response(on)[0].fetch()
        assert r.start == start and np.array_equal(r.array, want), name
        meta, stored = stack.final_record(f"{stack.config.name}-{name}")
        assert meta.status == "ok" and np.array_equal(stored.astype(np.int32), want), name


@pytest.fixture(scope="module")
def workers_fault(version, upstream, workers, sglang_stack) -> dict:
    """The same launch with the retarget failing as our own code would (`R3_TEST_FAULT_HOOKS`, `guard`)."""
    config = configs(version)["workers"]
    fault = {"R3_TEST_FAULT_HOOKS": "retarget_worker_app"}
    stack = sglang_stack(dataclasses.replace(config, name=f"{config.name}-fault", env=config.env | fault))
    return {"stack": stack, "responses": run_requests(stack)}


@pytest.mark.matrix  # a server start of its own for the fallback; CI proves the guard's kinds in test_guard.py
def test_a_failed_retarget_leaves_sglang_own_workers_app_loudly(upstream, workers_fault):
    """The guard calls `uvicorn.run` with SGLang's own arguments: the workers serve SGLang's app (rows inline, no
    shape beside them), the spool's record is that inline payload, and the failure is in the log and
    `/v1/engines`. Rows are compared within this server: once in two runs 0.5.16's CPU payload for the same
    tokens differed from the upstream server's here (SGLang's numerics, as the resume test notes)."""
    stack = workers_fault["stack"]
    for name in REQUESTS:
        up, on = upstream["responses"][name], workers_fault["responses"][name]
        assert on["output_ids"] == up["output_ids"], name
        assert "routed_experts_shape" not in on["meta_info"], name  # SGLang's workers' app, as it makes it
        meta, stored = stack.final_record(f"{stack.config.name}-{name}")
        assert meta.status == "ok" and np.array_equal(stored.astype(np.int32), stack.inline_rows(on)), name
    log = stack.server.log_text()
    failed = [line for line in log.splitlines() if "r3-sidecar: hook retarget_worker_app (uvicorn.run)" in line]
    assert len(failed) == 1 and "failed: InjectedFault" in failed[0], failed
    assert "tokenizer workers serve engine_ext.sglang.http_worker:app" not in log

    def degraded_hooks() -> set[str]:
        engines = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=30).json()["engines"]
        return {f["hook"] for engine in engines for f in engine.get("degraded") or ()}

    wait_until(lambda: "retarget_worker_app" in degraded_hooks(), 30, "the engine file's degraded retarget")
    assert degraded_hooks() == {"retarget_worker_app"}


@pytest.fixture(scope="module")
def http2(version, upstream, sglang_stack) -> dict:
    """`--enable-http2` in sidecar mode, where Granian's spawned workers build the responses."""
    stack = sglang_stack(configs(version)["http2"])
    return {"stack": stack, "responses": run_requests(stack), "answers": knock(stack)}


def test_granian_workers_keep_the_rows_inline_and_say_their_shape(upstream, http2):
    """Granian's workers are processes it spawns, which import SGLang's app by its literal path and load no
    plugin: no pointer can be attached there. Sidecar mode keeps SGLang's inline rows (the engine file says why,
    naming HTTP/2 on 0.5.12, the workers elsewhere), and the plugin has the workers import `http_worker`'s app
    (`worker_app.retarget_granian_app`), so every door's rows say their shape and decode with the bare
    `from_response(resp)[0].fetch()`, SGLang's payload byte for byte; the spool has each record. Before these
    hooks, 0.5.12's engine file said sidecar mode was in effect here (`inline_kept` null): its scheduler dropped
    the inline rows for a pointer that no Granian worker attaches."""
    stack = http2["stack"]
    log = stack.server.log_text()
    assert "Granian (HTTP/2) workers serve engine_ext.sglang.http_worker:app" in log
    assert "r3-sidecar: hook" not in log  # no guard stepped aside
    assert NOT_DELIVERED not in log, log[log.find(NOT_DELIVERED) - 200 :][:600]
    delivery = engine_report(stack)["delivery"]
    assert (delivery["mode"], delivery["configured_mode"]) == ("mirror", "sidecar"), delivery
    why = "--enable-http2" if stack.config.args.get("tokenizer-worker-num") is None else "--tokenizer-worker-num"
    assert why in delivery["inline_kept"], delivery
    for name, (_, extra) in REQUESTS.items():
        up, on = upstream["responses"][name], http2["responses"][name]
        assert_same_answer(name, upstream["stack"], up, on)
        want, start = stack.inline_rows(on), extra.get("routed_experts_start_len", 0)  # upstream's: above
        assert on["meta_info"]["routed_experts_shape"] == list(want.shape), name
        r = RoutedExpertsRef.from_response(on)[0].fetch()
        assert r.start == start and np.array_equal(r.array, want), name
        meta, stored = stack.final_record(f"{stack.config.name}-{name}")
        assert meta.status == "ok" and np.array_equal(stored.astype(np.int32), want), name
    for name, (answer, *_) in http2["answers"].items():
        assert answer["url"] is None and answer["inline"] is not None, name
        rows = answer["bare"].fetch().array
        assert rows.dtype == np.int32 and rows.tobytes() == base64.b64decode(answer["inline"]), name
