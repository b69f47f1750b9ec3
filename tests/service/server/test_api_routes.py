"""Contract 2 against a real uvicorn on 127.0.0.1: every route and status code, bodies byte-exact."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import numpy as np
import pybase64
import pytest
from helpers import FakeClock, engine_report, live_server, random_rows, when_waited, write_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_until

from service.server.settings import Settings
from service.spool import Spool


def url_for(base: str, rid: str) -> str:
    """Percent-encode every character of the rid that means something in a path, dot-only segments included
    (`.` and `..` would otherwise be removed by URL normalization before they reach the server)."""
    encoded = quote(rid, safe="")
    return f"{base}/routed_experts/{encoded.replace('.', '%2E') if set(encoded) == {'.'} else encoded}"


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    """The shared sidecar's deadline clock: it moves only when a test runs a wait out (`clock.run_out`)."""
    return FakeClock()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, clock: FakeClock) -> Iterator[tuple[str, Spool]]:
    """One sidecar for the read-only tests of this module (small chunks, to cross chunk boundaries)."""
    root = tmp_path_factory.mktemp("spool")
    settings = Settings.model_validate({"spool_dir": root, "chunk_bytes": 4096, "rescan_s": 60})
    with live_server(settings, deadline_clock=clock) as base:
        yield base, Spool(root)


def test_npy_is_default_and_exact_with_headers(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    for dtype, experts in (("uint8", 256), ("uint16", 300), ("int32", 70000)):
        rows = random_rows(700, layers=4, topk=8, num_experts=experts, seed=3)
        write_record(spool, f"npy-{dtype}", rows, num_experts=experts, layers=[1, 3, 5, 7], start=12, prompt_len=40)
        r = httpx.get(url_for(base, f"npy-{dtype}"))
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
        got = np.load(io.BytesIO(r.content), allow_pickle=False)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, rows)
        assert r.headers["x-r3-rid"] == f"npy-{dtype}"
        assert r.headers["x-r3-dtype"] == dtype
        assert r.headers["x-r3-shape"] == "700,4,8"
        assert r.headers["x-r3-start"] == "12"
        assert r.headers["x-r3-prompt-len"] == "40"
        assert r.headers["x-r3-layers"] == "1,3,5,7"
        assert r.headers["x-r3-final"] == "true" and r.headers["x-r3-status"] == "ok"
        assert int(r.headers["content-length"]) == len(r.content)


def test_sglang_b64_byte_identical(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    for n in (0, 1, 2, 3, 1001):  # lengths around multiples of 3, and many 4 KiB chunks
        rows = random_rows(n, layers=3, topk=5, seed=n)
        write_record(spool, f"b64-{n}", rows, layers=[0, 1, 2])
        r = httpx.get(url_for(base, f"b64-{n}"), params={"format": "sglang_b64"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert r.content == pybase64.b64encode(rows.astype(np.int32).tobytes())
        assert r.headers["x-r3-dtype"] == "int32"


def test_raw_and_json(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    rows = random_rows(300, layers=2, topk=4, seed=9)
    write_record(spool, "rawjson", rows, layers=[10, 20], num_experts=300)
    raw = httpx.get(url_for(base, "rawjson"), params={"format": "raw"})
    assert raw.headers["content-type"] == "application/octet-stream"
    assert raw.content == rows.astype(np.uint16).tobytes()
    js = httpx.get(url_for(base, "rawjson"), params={"format": "json"}).json()
    assert js["data"] == rows.tolist() and js["layers"] == [10, 20] and js["shape"] == [300, 2, 4]


def test_ranges_and_layer_subsets_exact(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    rows = random_rows(500, layers=4, topk=2, seed=5)
    write_record(spool, "rng", rows, layers=[2, 5, 9, 11], start=100)
    r = httpx.get(url_for(base, "rng"), params={"start": 150, "end": 420, "layers": "11,2", "format": "raw"})
    assert r.status_code == 200
    assert r.content == rows[50:320][:, [3, 0], :].astype(np.uint8).tobytes()
    assert (r.headers["x-r3-shape"], r.headers["x-r3-start"], r.headers["x-r3-layers"]) == ("270,2,2", "150", "11,2")
    whole_end = httpx.get(url_for(base, "rng"), params={"start": 599, "format": "npy"})
    np.testing.assert_array_equal(np.load(io.BytesIO(whole_end.content)), rows[499:])
    empty = httpx.get(url_for(base, "rng"), params={"start": 600, "end": 600, "format": "raw"})
    assert empty.status_code == 200 and empty.content == b""


@pytest.mark.parametrize(
    "params", [{"start": 99}, {"end": 601}, {"start": 300, "end": 200}, {"start": 601}, {"start": 0, "end": 10}]
)
def test_416_outside_rows(shared: tuple[str, Spool], params: dict) -> None:
    base, spool = shared
    if spool.read_meta("r416") is None:
        write_record(spool, "r416", random_rows(500, layers=1, topk=1), layers=[0], start=100)
    r = httpx.get(url_for(base, "r416"), params=params)
    assert r.status_code == 416
    assert r.json()["error"] == "range_not_satisfiable" and "[100, 600)" in r.json()["detail"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"start": "abc"}, "start"),
        ({"end": "1.5"}, "end"),
        ({"start": -1}, "start"),
        ({"layers": "1,,2"}, "layers"),
        ({"layers": "x"}, "layers"),
        ({"layers": "0,0"}, "repeats"),
        ({"layers": "0,7"}, "[7]"),
        ({"wait": 10_000}, "wait"),
        ({"wait": -1}, "wait"),
        ({"wait": "soon"}, "wait"),
        ({"format": "parquet"}, "format"),
        ({"stream": "maybe"}, "stream"),
    ],
)
def test_422_malformed_parameters(shared: tuple[str, Spool], params: dict, needle: str) -> None:
    base, spool = shared
    if spool.read_meta("r422") is None:
        write_record(spool, "r422", random_rows(5, layers=2, topk=1), layers=[0, 1])
    r = httpx.get(url_for(base, "r422"), params=params)
    assert r.status_code == 422
    body = r.json()
    assert set(body) == {"error", "detail"} and needle in body["detail"]


def test_404_unknown_record_and_route(shared: tuple[str, Spool]) -> None:
    base, _ = shared
    r = httpx.get(url_for(base, "never-written"))
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert r.json()["detail"].startswith("no record 'never-written' (never written here")
    r = httpx.get(f"{base}/no/such/route")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = httpx.put(f"{base}/healthz")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"


def test_202_when_not_final(shared: tuple[str, Spool], clock: FakeClock) -> None:
    base, spool = shared
    write_record(spool, "open-1", random_rows(7), final=False)
    r = httpx.get(url_for(base, "open-1"))
    assert r.status_code == 202 and r.json() == {
        "rid": "open-1",
        "rows": 7,
        "final": False,
        "detail": "record is not final yet: 7 rows so far (positions [0, 7))",
    }
    r = clock.run_out(lambda: httpx.get(url_for(base, "open-1"), params={"wait": 0.3}, timeout=30), 0.3)
    assert r.status_code == 202  # and only once the wait had run out (`run_out` checks the clock)


def test_aborted_is_served_and_error_is_410(shared: tuple[str, Spool]) -> None:
    """An aborted request's rows so far are what SGLang returns inline for it: partial rollouts resume from them."""
    base, spool = shared
    rows = random_rows(3, seed=4)
    write_record(spool, "ab", rows, status="aborted", start=2)
    write_record(spool, "er", random_rows(3), status="error")
    r = httpx.get(url_for(base, "ab"), params={"format": "raw", "start": 3})
    assert r.status_code == 200 and r.content == rows[1:].astype(np.uint8).tobytes()
    assert r.headers["x-r3-status"] == "aborted" and r.headers["x-r3-final"] == "true"
    assert r.headers["x-r3-start"] == "3" and r.headers["x-r3-shape"] == "2,4,8"
    assert httpx.get(url_for(base, "ab"), params={"start": 6}).status_code == 416
    r = httpx.get(url_for(base, "er"))
    assert r.status_code == 410 and r.json()["error"] == "record_error"


def test_odd_rids_roundtrip(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    odd = ["../../etc/passwd", "a/b/c", "ünï cødé ✓", "%2F..%2F", "q?x=1&y#z", "~tilde", ".", "..", "line\nbreak\n"]
    for i, rid in enumerate(odd):
        rows = random_rows(4, seed=i)
        write_record(spool, rid, rows)
        r = httpx.get(url_for(base, rid), params={"format": "raw"})
        assert r.status_code == 200, rid
        assert r.content == rows.astype(np.uint8).tobytes()
        assert r.headers["x-r3-rid"] == quote(rid, safe=":")
    assert all(p.parent == spool.records_dir for p in spool.records_dir.iterdir())


def test_wait_returns_as_soon_as_final(shared: tuple[str, Spool], clock: FakeClock) -> None:
    """Woken by the file-system event, not by polling nor the deadline: the clock does not move during the
    wait, and the rescan (60 s) lies past the client's 30 s timeout. The rows are written once the server
    has read its clock (its wait has begun), so the test always exercises the wake-up."""
    base, spool = shared
    rows = random_rows(20)
    writer = spool.writer("late", num_experts=128, topk=8, layers=[0, 1, 2, 3])
    reads = clock.reads

    def finish() -> None:
        clock.wait_reads(reads + 1)
        writer.append(rows)
        writer.finalize()

    threading.Thread(target=finish).start()
    r = httpx.get(url_for(base, "late"), params={"wait": 600, "format": "raw"}, timeout=30)
    assert r.status_code == 200 and r.content == rows.astype(np.uint8).tobytes()  # final: it waited for the rows


def test_wait_for_a_record_not_yet_created(shared: tuple[str, Spool], clock: FakeClock) -> None:
    """Woken by the record's creation (as above: neither the deadline nor the rescan can end the wait within the
    client's timeout); a rid that never comes is 404 once the wait has run out."""
    base, spool = shared
    rows = random_rows(3)
    with when_waited(base, "unborn", lambda: write_record(spool, "unborn", rows)):
        r = httpx.get(url_for(base, "unborn"), params={"wait": 600, "format": "raw"}, timeout=30)
    assert r.status_code == 200 and r.content == rows.astype(np.uint8).tobytes()
    r = clock.run_out(lambda: httpx.get(url_for(base, "still-unborn"), params={"wait": 0.2}, timeout=30), 0.2)
    assert r.status_code == 404


def test_delete_frees_files(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    write_record(spool, "del/me", random_rows(50))
    assert spool.bin_path("del/me").exists()
    assert httpx.delete(url_for(base, "del/me")).status_code == 204
    assert not spool.bin_path("del/me").exists() and not spool.meta_path("del/me").exists()
    r = httpx.get(url_for(base, "del/me"))
    assert r.status_code == 410 and r.json()["error"] == "acknowledged" and "acknowledged" in r.json()["detail"]
    frame = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["del/me"]}).content
    assert b'"status":410' in frame and b'"error":"acknowledged"' in frame
    r = httpx.delete(url_for(base, "del/me"))  # a repeated ack stays a 404 (`ack(missing_ok=True)`), saying why
    assert r.status_code == 404 and r.json()["error"] == "not_found" and "already acknowledged" in r.json()["detail"]
    # A wait on an acknowledged rid still waits (SGLang may reuse a rid): the record written again answers it.
    with when_waited(base, "del/me", lambda: write_record(spool, "del/me", random_rows(3))):
        assert httpx.get(url_for(base, "del/me"), params={"wait": 30}, timeout=60).status_code == 200


def test_engines_health_ready(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    spool.write_engine(engine_report("pod-a/dp0"))
    engines = httpx.get(f"{base}/v1/engines").json()["engines"]
    assert [e["engine"] for e in engines] == ["pod-a/dp0"] and engines[0]["budget"][0]["buffer"] == "device_cache"
    assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{base}/readyz").json() == {"status": "ready"}


def test_bad_spool_files_are_skipped_and_service_keeps_serving(shared: tuple[str, Spool]) -> None:
    base, spool = shared
    rdir = spool.records_dir
    (rdir / "garbage.json").write_bytes(b"{not json")
    (rdir / "future.json").write_bytes(b'{"v": 2, "rid": "future"}')
    (rdir / "wrongname.json").write_bytes(write_record(spool, "rightname", random_rows(1)).to_json())
    meta = write_record(spool, "trunc", random_rows(100))
    os.truncate(spool.bin_path("trunc"), meta.row_bytes * 10)
    (spool.engines_dir / "broken.json").write_bytes(b"[]")
    for rid, code in (("garbage", 404), ("future", 404), ("wrongname", 404), ("trunc", 410), ("rightname", 200)):
        r = httpx.get(url_for(base, rid))
        assert r.status_code == code, (rid, r.text)
    assert httpx.get(url_for(base, "trunc")).json()["error"] == "truncated_bin"
    assert httpx.get(f"{base}/v1/engines").status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    counts = {"bad_json": 1, "unknown_version": 2, "name_mismatch": 1, "truncated_bin": 1}  # v=2 record + `[]` engine
    for reason, count in counts.items():  # each counted once, however often it was seen or asked for
        assert f'r3_spool_skipped_total{{reason="{reason}"}} {count}.0' in metrics, reason
    assert httpx.get(url_for(base, "rightname"), params={"format": "raw"}).status_code == 200


def test_auth(serve, spool: Spool) -> None:
    base = serve(auth_token="s3cret")
    write_record(spool, "secured", random_rows(2))
    good = {"Authorization": "Bearer s3cret"}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic czNjcmV0"}):
        r = httpx.get(url_for(base, "secured"), headers=headers)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/engines").status_code == 401
    assert httpx.delete(url_for(base, "secured")).status_code == 401
    assert httpx.post(f"{base}/routed_experts/batch", json={"rids": ["secured"]}).status_code == 401
    assert httpx.get(url_for(base, "secured"), params={"start": "x"}).status_code == 401
    for open_path in ("/metrics", "/healthz", "/readyz"):
        assert httpx.get(f"{base}{open_path}").status_code == 200
    assert httpx.get(url_for(base, "secured"), headers=good).status_code == 200
    assert httpx.get(f"{base}/v1/engines", headers=good).status_code == 200
    assert httpx.delete(url_for(base, "secured"), headers=good).status_code == 204
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    spec = httpx.get(f"{base}/openapi.json", headers=good).json()
    assert "401" in spec["paths"]["/routed_experts/{rid}"]["get"]["responses"]
    assert spec["paths"]["/routed_experts/{rid}"]["get"]["security"] == [{"HTTPBearer": []}]


def test_startup_rebuilds_index_from_existing_files(spool: Spool, make_settings) -> None:
    rows = random_rows(9)
    write_record(spool, "before-start", rows)
    write_record(spool, "before-start-open", rows, final=False)
    with live_server(make_settings(rescan_s=60)) as base:
        assert (
            httpx.get(url_for(base, "before-start"), params={"format": "raw"}).content
            == rows.astype(np.uint8).tobytes()
        )
        text = httpx.get(f"{base}/metrics").text
        assert 'r3_records{state="ok"} 1.0' in text and 'r3_records{state="open"} 1.0' in text


def test_openapi_documents_every_route(shared: tuple[str, Spool]) -> None:
    base, _ = shared
    spec = httpx.get(f"{base}/openapi.json").json()
    get = spec["paths"]["/routed_experts/{rid}"]["get"]
    assert {"200", "202", "404", "410", "416", "422"} <= set(get["responses"])
    assert "401" not in get["responses"] and "security" not in get, "no token configured: the API is open"
    assert {"application/x-npy", "application/octet-stream", "text/plain", "application/vnd.r3.frames"} <= set(
        get["responses"]["200"]["content"]
    )
    assert {p["name"] for p in get["parameters"]} == {
        "rid",
        "format",
        "start",
        "end",
        "layers",
        "wait",
        "stream",
        "clamp",
        "suspect",
        "sglang_dtype",
    }
    assert set(spec["paths"]["/routed_experts/{rid}"]) == {"get", "delete"}
    assert {"/routed_experts/batch", "/v1/engines", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])


def test_body_size_bounded(serve) -> None:
    base = serve(max_batch=2)
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["a", "b", "c"]})
    assert r.status_code == 422 and "rids" in r.json()["detail"]
    r = httpx.post(f"{base}/routed_experts/batch", content=b"x" * 200_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    r = httpx.post(f"{base}/routed_experts/batch", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_parameter"
    r = httpx.post(f"{base}/routed_experts/batch", content=b"\xff\xfe[", headers={"content-type": "application/json"})
    assert r.status_code == 422 and set(r.json()) == {"error", "detail"}
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["a"], "layers": [False]})
    assert r.status_code == 422 and "layers" in r.json()["detail"]


def test_405_allow_lists_every_method_of_the_path(shared: tuple[str, Spool]) -> None:
    base, _ = shared
    r = httpx.request("OPTIONS", f"{base}/routed_experts/some-rid")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    r = httpx.put(f"{base}/routed_experts/batch")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def served_499(base: str) -> float:
    """`r3_served_total{code="499",format="raw"}`: answers cut off because the client stopped reading."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("r3_served_total{") and 'code="499"' in line and 'format="raw"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.usefixtures("gc_off")  # the 499 may not wait for the collector to close the body
def test_stalled_reader_is_cut_off_by_the_send_timeout(spool: Spool, make_settings) -> None:
    """A client that stops reading loses its connection after `send_timeout_s`, not at the end of time."""
    rows = random_rows(1 << 19, layers=8, topk=8)  # 32 MiB: far more than the socket buffers hold
    write_record(spool, "huge", rows, layers=list(range(8)))
    with live_server(make_settings(send_timeout_s=0.5)) as base:
        host, port = base.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.sendall(b"GET /routed_experts/huge?format=raw HTTP/1.1\r\nHost: x\r\n\r\n")
        # read nothing until the server has cut the answer off (it counts it as 499: the reader stopped)
        wait_until(lambda: served_499(base) != 0, 30, "the stalled reader cut off (a 499 counted)")
        received = 0
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        sock.close()
        assert 0 < received < rows.size, "the server must have cut the body short"
        assert httpx.get(f"{base}/healthz").status_code == 200


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rid=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=40),
    dtype=st.sampled_from(["uint8", "uint16", "int32"]),
    n=st.integers(0, 300),
    bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    fmt=st.sampled_from(["raw", "npy", "sglang_b64"]),
    data=st.data(),
)
def test_any_rid_any_range_any_layers_exact(
    shared: tuple[str, Spool], rid: str, dtype: str, n: int, bounds: tuple[float, float], fmt: str, data: st.DataObject
) -> None:
    base, spool = shared
    layers = [3, 7, 11, 20]
    rows = random_rows(n, layers=4, topk=3, num_experts=200, seed=n)
    write_record(spool, rid, rows, num_experts=200, layers=layers, start=17, dtype=dtype)
    lo, hi = sorted(int(b * n) for b in bounds)
    wanted = data.draw(st.lists(st.sampled_from(layers), min_size=1, max_size=4, unique=True))
    slots = [layers.index(w) for w in wanted]
    params = {"format": fmt, "start": 17 + lo, "end": 17 + hi, "layers": ",".join(map(str, wanted))}
    r = httpx.get(url_for(base, rid), params=params)
    assert r.status_code == 200, (rid, r.url.raw_path, r.text)
    expected = rows[lo:hi][:, slots].astype(dtype)
    if fmt == "raw":
        assert r.content == expected.tobytes()
    elif fmt == "npy":
        got = np.load(io.BytesIO(r.content), allow_pickle=False)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, expected)
    else:
        assert r.content == pybase64.b64encode(expected.astype(np.int32).tobytes())
    assert r.headers["x-r3-shape"] == f"{hi - lo},{len(wanted)},3"
