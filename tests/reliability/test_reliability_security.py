"""Item 6: auth, path safety of rids, bounded inputs, least privilege, and no payload in logs.

Each test runs the real sidecar process (`r3-sidecar serve`) on loopback and attacks it over HTTP.
"""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote, unquote

import httpx
import numpy as np
import orjson
import pytest
from r3_harness import proc_cap_eff, proc_uid
from waiting import wait_until

from service.spool import Spool

TOKEN = "s3cret-token-for-tests"
DATA_ROUTES = [
    ("GET", "/routed_experts/some-rid", None),
    ("GET", "/routed_experts/some-rid?stream=true", None),
    ("DELETE", "/routed_experts/some-rid", None),
    ("POST", "/routed_experts/batch", {"rids": ["some-rid"]}),
    ("GET", "/v1/engines", None),
]
PATTERN = b"R3PAYLOADSECRET!"  # one row: 4 layers x top-4 of uint8


def _write_pattern_record(spool_dir: Path, rid: str, rows: int = 64) -> np.ndarray:
    arr = np.frombuffer(PATTERN * rows, dtype=np.uint8).reshape(rows, 4, 4)
    w = Spool(spool_dir).writer(rid, num_experts=256, topk=4, layers=[0, 1, 2, 3], prompt_len=rows)
    w.append(arr)
    w.finalize()
    return arr


def _assert_error_json(r: httpx.Response, code: int) -> None:
    assert r.status_code == code, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) >= {"error", "detail"} and body["detail"], body


def test_auth_required_on_every_data_route(make_sidecar, spool_dir):
    _write_pattern_record(spool_dir, "some-rid")
    side = make_sidecar(spool_dir, env={"R3_AUTH_TOKEN": TOKEN})
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {base64.b64encode(TOKEN.encode()).decode()}"},
        {"Authorization": "Bearer"},
        {"X-R3-Token": TOKEN},
    ]
    with httpx.Client(base_url=side.url, timeout=10) as client:
        for method, path, body in DATA_ROUTES:
            for headers in bad_headers:
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)
                _assert_error_json(r, 401)
                assert PATTERN not in r.content
        for path in ("/metrics", "/healthz", "/readyz"):
            assert client.get(path).status_code == 200, path
        good = {"Authorization": f"Bearer {TOKEN}"}
        r = client.get("/routed_experts/some-rid", params={"format": "raw"}, headers=good)
        assert r.status_code == 200 and r.content.startswith(PATTERN)
        assert client.get("/v1/engines", headers=good).status_code == 200
        assert client.delete("/routed_experts/some-rid", headers=good).status_code == 204
        gone = client.get("/routed_experts/some-rid", headers=good)  # acknowledged: 410 says so (docs/api.md)
        assert gone.status_code == 410 and "acknowledged" in gone.text, gone.text


def _raw_request(port: int, method: str, path: str) -> tuple[int, bytes]:
    """Send `path` exactly as given (httpx would remove `..` segments before the server sees them)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_only_health_and_metrics_are_open_with_a_token(make_sidecar, spool_dir):
    side = make_sidecar(spool_dir, env={"R3_AUTH_TOKEN": TOKEN})
    with httpx.Client(base_url=side.url, timeout=10) as client:
        opened = {p: client.get(p).status_code for p in ("/openapi.json", "/docs", "/redoc")}
        free = {p: client.get(p).status_code for p in ("/healthz", "/readyz", "/metrics")}
        schema = client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert opened == {"/openapi.json": 401, "/docs": 404, "/redoc": 404}, opened
    assert set(free.values()) == {200}, free
    assert schema.status_code == 200 and "/routed_experts/{rid}" in schema.json()["paths"]


HOSTILE_RIDS = [
    "..",
    "../outside",
    "../../outside",
    "..%2Foutside",
    "/etc/passwd",
    "a/../../outside",
    "v1/../../outside",
    "x\x00y",
    "\x00",
    "é🙂/..",
    "~" + "0" * 40,
    "." * 300,
    "a" * 5000,
    "..\\outside",
    "%2e%2e",
    "\u202e..",
    "rid\n\r\tX",
    "~../outside",
]


def test_rids_never_name_a_path_outside_the_spool(make_sidecar, spool_dir):
    outside = spool_dir.parent
    # Decoys a path-joining server would serve or delete: valid-looking records one and two levels up.
    for where in (outside, spool_dir / "v1", spool_dir):
        where.mkdir(parents=True, exist_ok=True)
        meta = {
            "v": 1,
            "rid": "outside",
            "dtype": "uint8",
            "num_experts": 256,
            "topk": 4,
            "layers": [0, 1, 2, 3],
            "start": 0,
            "rows": 1,
            "prompt_len": 1,
            "final": True,
            "status": "ok",
            "engine": "x",
            "weight_version": None,
            "created": 1.0,
            "updated": 1.0,
        }
        (where / "outside.json").write_bytes(orjson.dumps(meta))
        (where / "outside.bin").write_bytes(PATTERN)
    before = {p: p.stat().st_mtime_ns for p in outside.rglob("*") if p.is_file()}
    side = make_sidecar(spool_dir)
    with httpx.Client(base_url=side.url, timeout=10) as client:
        for rid in HOSTILE_RIDS:
            for path in (f"/routed_experts/{quote(rid, safe='')}", f"/routed_experts/{quote(rid, safe='/')}"):
                for method in ("GET", "DELETE"):
                    status, body = _raw_request(side.port, method, path + ("?format=raw" if method == "GET" else ""))
                    assert status in (404, 414, 422), (method, path[:80], status, body[:200])
                    assert PATTERN not in body
        r = client.post("/routed_experts/batch", json={"rids": HOSTILE_RIDS})
        assert r.status_code in (200, 422), r.status_code
        assert PATTERN not in r.content
        after = {p: p.stat().st_mtime_ns for p in outside.rglob("*") if p.is_file()}
        for p, mtime in before.items():
            assert after.get(p) == mtime, f"{p} was changed or deleted"
        # The same hostile names work as rids when a record really has them: stored under a hashed name.
        for rid in ["../outside", "x\x00y", "é🙂/..", "a" * 1000]:
            arr = _write_pattern_record(spool_dir, rid, rows=3)
            r = client.get(f"/routed_experts/{quote(rid, safe='')}", params={"format": "raw", "wait": 5})
            assert r.status_code == 200 and r.content == arr.tobytes(), (rid[:20], r.status_code, r.text[:200])
            assert unquote(r.headers["X-R3-Rid"]) == rid, r.headers["X-R3-Rid"][:80]
            assert client.delete(f"/routed_experts/{quote(rid, safe='')}").status_code == 204
        assert not [p for p in (spool_dir / "v1" / "records").iterdir() if not p.name.startswith(".")]
        assert {p: p.stat().st_mtime_ns for p in before} == before, "a decoy outside the records dir changed"
    assert side.proc.poll() is None


def test_request_sizes_wait_and_batches_are_bounded(make_sidecar, spool_dir):
    side = make_sidecar(spool_dir, env={"R3_MAX_BATCH": "16", "R3_MAX_WAIT_S": "30"})
    _write_pattern_record(spool_dir, "r", rows=8)
    with httpx.Client(base_url=side.url, timeout=30) as client:
        for wait in ("31", "601", "-1", "1e309", "nan", "inf", "abc", "99999999999999999999"):
            _assert_error_json(client.get("/routed_experts/r", params={"wait": wait}), 422)
        for params, code in [
            ({"start": "-1"}, (416, 422)),
            ({"start": str(2**70)}, (416, 422)),
            ({"end": "0"}, (200, 416)),
            ({"end": "9"}, (416,)),
            ({"start": "5", "end": "3"}, (416, 422)),
            ({"end": str(10**30)}, (416, 422)),
            ({"layers": "9"}, (422,)),
            ({"layers": ",".join(["0"] * 3000)}, (414, 422, 431)),
            ({"format": "pickle"}, (422,)),
        ]:
            r = client.get("/routed_experts/r", params=params)
            assert r.status_code in code, (params if len(str(params)) < 100 else "long", r.status_code)
        r = client.post("/routed_experts/batch", json={"rids": [f"r{i}" for i in range(17)]})
        assert r.status_code in (413, 422), r.status_code
        r = client.post("/routed_experts/batch", json={"rids": ["r"], "wait": 31})
        assert r.status_code == 422, r.status_code
        big = b'{"rids": [' + b",".join([b'"' + b"x" * 1000 + b'"'] * 20000) + b"]}"  # 20 MB body
        try:
            r = client.post("/routed_experts/batch", content=big, headers={"Content-Type": "application/json"})
            assert r.status_code in (413, 422), r.status_code
        except httpx.HTTPError:
            pass  # the server may cut an oversized upload short; it must stay up (checked below)
        r = client.post("/routed_experts/batch", content=b"[" * 100000, headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 413, 422), r.status_code
        status, _ = _raw_request(side.port, "GET", "/routed_experts/" + "a" * 100_000)
        assert status in (400, 404, 414, 422, 431), status
        assert client.get("/routed_experts/r", params={"format": "raw"}).content == PATTERN * 8
    assert side.proc.poll() is None


def _shared_tmp() -> Path:
    """A temp dir another uid can reach (pytest's tmp_path is 0700 under root)."""
    base = Path(tempfile.mkdtemp(prefix="r3-rel-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    base.chmod(0o755)
    return base


def _reachable_by_others(path: Path) -> bool:
    """Whether uid 65534 could exec `path`: every parent directory searchable by others."""
    real = path.resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents) and bool(real.stat().st_mode & stat.S_IXOTH)


def _least_privilege() -> tuple[str, dict, int]:
    """How to run the sidecar unprivileged here, and the capability mask it may hold.

    As ourselves when not root; as uid 65534 when root and the interpreter is reachable by it; else as uid 65534
    keeping only CAP_DAC_READ_SEARCH (read and search, never write), to reach an interpreter under `/root`.
    """
    if os.geteuid() != 0:
        return "the invoking non-root user", {}, 0
    if _reachable_by_others(Path(sys.executable)):
        return "uid 65534", {"user": 65534, "group": 65534}, 0
    wrap = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all,+dac_read_search",
        "--ambient-caps=+dac_read_search",
        "--bounding-set=-all,+dac_read_search",
    ]
    if shutil.which("setpriv") and subprocess.run([*wrap, "true"], capture_output=True).returncode == 0:
        return "uid 65534 with only CAP_DAC_READ_SEARCH (the interpreter lives under /root)", {"wrap": wrap}, 1 << 2
    pytest.skip("root, with no way to drop to an unprivileged uid here (setpriv missing or not permitted)")


def test_runs_unprivileged_with_only_the_spool_writable(make_sidecar):
    mode, how, allowed_caps = _least_privilege()
    base = _shared_tmp()
    try:
        spool_dir, ro = base / "spool", base / "ro"
        spool_dir.mkdir()
        ro.mkdir()
        writer_spool = Spool(spool_dir)
        if os.geteuid() == 0:
            for d in (spool_dir, spool_dir / "v1", writer_spool.records_dir, writer_spool.engines_dir):
                os.chown(d, 65534, 65534)
        ro.chmod(0o555)
        env = {
            "HOME": str(ro),
            "TMPDIR": str(ro),
            "XDG_CACHE_HOME": str(ro),
            "R3_TTL_S": "1",
            "R3_RESCAN_S": "0.5",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        side = make_sidecar(spool_dir, env=env, cwd=ro, **how)
        caps = proc_cap_eff(side.pid)
        assert caps & ~allowed_caps == 0, f"the sidecar holds capabilities {caps:#x}"
        assert proc_uid(side.pid) != 0, "the sidecar runs as root"
        with httpx.Client(base_url=side.url, timeout=10) as client:
            for i in range(3):
                _write_pattern_record(spool_dir, f"p{i}", rows=4)
                r = client.get(f"/routed_experts/p{i}", params={"format": "raw", "wait": 5})
                assert r.status_code == 200 and r.content == PATTERN * 4
                assert client.get("/metrics").status_code == 200
            assert client.delete("/routed_experts/p0").status_code == 204
            writable = _writable_fds(side.pid)
            assert all(Path(p).is_relative_to(spool_dir) for p in writable), writable
            # TTL expiry: the sidecar deletes p1, p2 itself
            wait_until(lambda: client.get("/routed_experts/p1").status_code in (404, 410), 30, "p1 expired")
        assert list(ro.iterdir()) == [], f"wrote outside the spool: {list(ro.iterdir())}"
        assert "PermissionError" not in side.log_tail(100_000), side.log_tail()
        assert side.proc.poll() is None
        print(f"least privilege: sidecar ran as {mode}; cwd, HOME and TMPDIR read-only; only the spool written")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _writable_fds(pid: int) -> list[str]:
    """Regular files the process holds open for writing (flags from /proc/<pid>/fdinfo)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if int(fd) <= 2:
            continue  # stdout/stderr: the log stream the deployment hands in
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        except (FileNotFoundError, IndexError):
            continue
        if target.startswith("/") and flags & (os.O_WRONLY | os.O_RDWR) and os.path.isfile(target):
            out.append(target)
    return out


def test_no_payload_bytes_in_logs(make_sidecar, spool_dir):
    arr = _write_pattern_record(spool_dir, "secret-rid", rows=32)
    side = make_sidecar(spool_dir)
    with httpx.Client(base_url=side.url, timeout=10) as client:
        for fmt in ("npy", "raw", "json", "sglang_b64"):
            assert client.get("/routed_experts/secret-rid", params={"format": fmt}).status_code == 200
        assert client.get("/routed_experts/secret-rid", params={"stream": "true"}).status_code == 200
        assert client.post("/routed_experts/batch", json={"rids": ["secret-rid", "nope"]}).status_code == 200
        assert client.get("/routed_experts/secret-rid", params={"start": "1000"}).status_code == 416
        assert client.get("/routed_experts/secret-rid", params={"layers": "9"}).status_code == 422
    side.stop()
    log = Path(side.log_path).read_bytes()
    as_json = orjson.dumps(arr.tolist())
    b64 = base64.b64encode(arr.astype(np.int32).tobytes())
    needles = {
        "raw": PATTERN[:8],
        "json": as_json[10:40],
        "json-spaced": b"82, 51, 80, 65",
        "sglang_b64": b64[64:96],
        "raw-b64": base64.b64encode(PATTERN * 3)[8:32],
    }
    found = {name: needle for name, needle in needles.items() if needle in log}
    assert not found, f"payload in logs: {found}"
