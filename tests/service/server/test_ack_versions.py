"""Step-scoped acknowledgement and weight versions, against a real uvicorn on 127.0.0.1.

`POST /routed_experts/ack` frees records by a list of rids or by weight version (every final record whose
integer version is older), counted in `r3_acked_total`; bad bodies get a 422 that says what was wrong and free
nothing. Records that span a weight update serve their versions in headers, frames and the clients.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from helpers import random_rows

from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient
from service.spool import Spool
from service.spool.record.meta import RecordMeta


def put(spool: Spool, rid: str, version: str | int | None, *, final: bool = True, spans=()) -> RecordMeta:
    writer = spool.writer(rid, num_experts=128, topk=8, layers=[0, 1, 2, 3], prompt_len=3, weight_version=version)
    writer.append(random_rows(6, seed=len(rid)).astype(np.uint8))
    return writer.finalize("ok", weights=(version, spans)) if final else writer.meta


def acked_total(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("r3_acked_total{"):
            how = line.split('how="')[1].split('"')[0]
            out[how] = float(line.rsplit(" ", 1)[1])
    return out


def test_ack_by_rids_frees_them_and_lists_the_unknown(spool: Spool, base_url: str) -> None:
    for rid in ("a", "b", "c"):
        put(spool, rid, "1")
    with RoutedExpertsClient(base_url) as client:
        assert client.ack_many(["a", "b", "nope", "a"]) == {"acked": 2, "missing": ["nope"]}
        assert client.get("c").rows == 6
    assert not spool.meta_path("a").exists() and not spool.meta_path("b").exists()
    assert httpx.get(f"{base_url}/routed_experts/a").status_code == 410  # acknowledged, not unknown
    assert acked_total(base_url) == {"delete": 0, "rids": 2, "weight_version": 0}


def test_ack_before_a_version_frees_older_final_records_only(spool: Spool, base_url: str) -> None:
    put(spool, "old-int", 3)
    put(spool, "old-str", "4")
    put(spool, "current", "5")
    put(spool, "open-old", "2", final=False)  # still being written: kept
    put(spool, "named", "default")  # not an integer: kept, counted
    put(spool, "unknown", None)  # an older plugin wrote no version: kept, counted
    with RoutedExpertsClient(base_url) as client:
        assert client.ack_many(before_weight_version=5) == {"acked": 2, "unordered": 2}
    left = {p.stem for p in spool.records_dir.glob("*.json")}
    assert left == {"current", "open-old", "named", "unknown"}

    async def again() -> dict:
        async with AsyncRoutedExpertsClient(base_url) as client:
            return await client.ack_many(before_weight_version="6")

    assert asyncio.run(again()) == {"acked": 1, "unordered": 2}
    assert acked_total(base_url)["weight_version"] == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "exactly one"),
        ({"rids": ["a"], "before_weight_version": 3}, "exactly one"),
        ({"before_weight_version": "v3"}, "not an integer"),
        ({"rids": "a"}, "rids"),
        ({"rids": [""]}, "rids"),
        ({"rid": ["a"]}, "rid"),
    ],
)
def test_bad_ack_bodies_are_422_and_free_nothing(spool: Spool, base_url: str, body: dict, needle: str) -> None:
    put(spool, "a", 1)
    response = httpx.post(f"{base_url}/routed_experts/ack", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] and needle in response.json()["detail"]
    assert spool.meta_path("a").exists()


def test_versions_are_served_in_headers_frames_and_clients(spool: Spool, base_url: str) -> None:
    put(spool, "spans", "v 2", spans=((0, "v1"), (4, "v 2")))
    put(spool, "plain", "v1")
    response = httpx.get(f"{base_url}/routed_experts/spans")
    assert response.headers["x-r3-weight-version"] == "v%202"
    assert response.headers["x-r3-weight-versions"] == "0:v1,4:v%202"
    with RoutedExpertsClient(base_url) as client:
        got = client.get("spans", start=2, end=5)
        assert (got.weight_version, got.weight_versions) == ("v 2", ((0, "v1"), (4, "v 2")))
        framed = client.get_many(["spans", "plain"])
        assert [(r.weight_version, r.weight_versions) for r in framed] == [
            ("v 2", ((0, "v1"), (4, "v 2"))),
            ("v1", ()),
        ]
    meta = spool.read_meta("spans")
    assert [meta.version_at(p) for p in range(6)] == ["v1"] * 4 + ["v 2"] * 2
