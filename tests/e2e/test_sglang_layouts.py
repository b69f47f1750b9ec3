"""Every layout of the plugin in a real CPU server in CI: one release for each layout no other CI module serves.

The plugin has one layout per group of SGLang releases whose code differs for it (`compat.LAYOUTS`); CI reads
every release's own wheel against its layout (`test_release_wheels.py`), and this module runs the hooks of each
layout for real, from the release `tiers.LAYOUT_SMOKE` names (its venv of `make env-sglang-releases`), so a
layout's code path that only the matrix ran cannot break unseen. One server per layout, in mirror mode: the
start-up line and engine file name the release and its layout, proven; each response's inline rows and tokens
are those of SGLang 0.5.23 with the plugin off (checked off), for the same requests; each record, in the spool
and as the response's pointer fetches it from the sidecar, is that response's inline payload byte for byte.

Why one plugin-off server serves as every layout's reference: the releases run the same torch (2.13.0, CPU) in
float32, and the seeded model's routing does not depend on the release (the same rows and tokens, request for
request, from 0.5.13, 0.5.16, 0.5.19, 0.5.22 and 0.5.23's plugin-off servers, 2026-11-29); a release that
routed otherwise fails here by name. The whole version suite of every release is `make test-matrix`'s.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from sglang_server import Config
from tiers import LAYOUT_SMOKE
from version_servers import REQUESTS, assert_same_answer, engine_report, run_requests, venv_python

from engine_ext.sglang.versions import RELEASES, support

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # a server start counts in its first test

REFERENCE = Config("layouts-upstream", plugin=False, sidecar=False)  # SGLang 0.5.23, the plugin off


@pytest.fixture(scope="module")
def reference(sglang_stack) -> dict:
    """The plugin-off server's answers (kept after the pool replaces it: only their rows are read later)."""
    stack = sglang_stack(REFERENCE)
    responses = run_requests(stack)
    for response in responses.values():
        stack.assert_plugin_off(response["meta_info"])
    return {"stack": stack, "responses": responses}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            release,
            id=f"layout-{layout}",
            marks=pytest.mark.skipif(
                not venv_python(release).exists(), reason=f"needs .venv-sglang-{release} (make env-sglang-releases)"
            ),
        )
        for layout, release in LAYOUT_SMOKE.items()
    ],
)
def served(request: pytest.FixtureRequest, reference, sglang_stack) -> dict:
    """One release's mirror server and its answers to the reference's requests."""
    release = request.param
    config = Config("layout-" + release.replace(".", ""), env={"R3_MODE": "mirror"}, python=str(venv_python(release)))
    stack = sglang_stack(config)
    return {"release": release, "stack": stack, "responses": run_requests(stack)}


def test_the_release_gets_its_layout_proven_and_says_so(served) -> None:
    release, stack = served["release"], served["stack"]
    plan = support(release, RELEASES[release])
    log = stack.server.log_text()
    assert plan.proven and plan.describe() in log, log[-3000:]
    assert "registering no hooks" not in log and "r3-sidecar: hook" not in log
    report = engine_report(stack)
    assert report["sglang"] == release
    assert (report["build"]["layout"], report["build"]["proven"]) == (RELEASES[release], True)


def test_its_answers_are_the_plugin_off_engines(reference, served) -> None:
    for name in REQUESTS:
        assert_same_answer(name, reference["stack"], reference["responses"][name], served["responses"][name])


def test_its_records_are_the_inline_payload_byte_for_byte(served) -> None:
    stack = served["stack"]
    with httpx.Client(timeout=30) as client:
        for name, (ids, extra) in REQUESTS.items():
            response = served["responses"][name]
            meta_info = response["meta_info"]
            served_rows = client.get(meta_info["routed_experts_url"], params={"format": "sglang_b64", "wait": 10})
            assert served_rows.status_code == 200, (name, served_rows.text)
            assert served_rows.text == meta_info["routed_experts"], name
            meta, stored = stack.final_record(meta_info["id"])
            assert (meta.status, meta.prompt_len, meta.start) == (
                "ok",
                len(ids),
                extra.get("routed_experts_start_len", 0),
            )
            assert np.array_equal(stored.astype(np.int32), stack.inline_rows(response)), name
    assert stack.suspect_rids() == []
