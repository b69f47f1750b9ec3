"""Item 5 (HTTP half): schemathesis against the sidecar's own OpenAPI schema (`/openapi.json`).

Valid and invalid requests for every operation; every response must be a non-5xx that conforms to the schema
(status code, content type, headers, body), and invalid input must be rejected with a 4xx. Path parameters are
sometimes swapped for rids of records that exist (final ok, aborted, hostile names), so 200/410/416 paths run too.
The fast test draws 40 cases per operation; the `slow` twin 400. `-s` prints the count per operation and status.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import schemathesis
from hypothesis import strategies as st
from r3_harness import LAYERS, NUM_EXPERTS, TOPK, Sidecar, expected_rows
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.spool import Spool

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
KNOWN = ["fz-ok", "fz-aborted", "fz-empty", "../fz", "é🙂 x", "fz-big"]
EXAMPLES = int(os.environ.get("R3_FUZZ_EXAMPLES", "40"))
CASES: collections.Counter[str] = collections.Counter()


def _seed(spool_dir) -> None:
    spool = Spool(spool_dir)
    for rid in KNOWN:
        rows = {"fz-empty": 0, "fz-big": 4000}.get(rid, 24)
        w = spool.writer(rid, num_experts=NUM_EXPERTS, topk=TOPK, layers=LAYERS, start=3, prompt_len=10)
        if rows:
            w.append(expected_rows(rid, rows))
        w.finalize("aborted" if rid == "fz-aborted" else "ok")


@pytest.fixture(scope="module")
def fuzz_sidecar(tmp_path_factory):
    pytest.importorskip("service.api")
    spool_dir = tmp_path_factory.mktemp("fuzz") / "spool"
    _seed(spool_dir)
    side = Sidecar(spool=spool_dir, env={"R3_MAX_WAIT_S": "0.2", "R3_STALE_S": "2", "R3_MAX_BATCH": "8"},
                   log_path=spool_dir.parent / "sidecar.log").start()
    yield side
    side.stop()
    print(f"\nschemathesis: {sum(CASES.values())} cases: {dict(sorted(CASES.items()))}")


@pytest.fixture
def api_schema(fuzz_sidecar):
    schema = schemathesis.openapi.from_url(fuzz_sidecar.url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES,
                                    database="none")

    @schema.hook
    def flatmap_path_parameters(_ctx, path_parameters):
        if "rid" not in path_parameters:
            return st.just(path_parameters)
        return st.one_of(st.just(path_parameters), st.sampled_from(KNOWN).map(lambda rid: {**path_parameters,
                                                                                             "rid": rid}))

    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_api_conforms_to_its_schema(case):
    response = case.call_and_validate(checks=CHECKS, timeout=20)
    CASES[f"{case.method} {case.path} {response.status_code}"] += 1


def test_known_records_survive_fuzzing(fuzz_sidecar):
    """The fuzzer may delete records; whatever remains is still exact (the server kept serving correctly)."""
    import httpx

    with httpx.Client(base_url=fuzz_sidecar.url, timeout=10) as client:
        r = client.get("/routed_experts/fz-big", params={"format": "raw"})
        assert r.status_code in (200, 404)
        if r.status_code == 200:
            assert np.array_equal(np.frombuffer(r.content, np.uint8).reshape(-1, len(LAYERS), TOPK),
                                  expected_rows("fz-big", 4000))
    assert fuzz_sidecar.proc.poll() is None
