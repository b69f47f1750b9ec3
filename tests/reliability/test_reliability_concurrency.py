"""Item 8: many writer processes (like DP ranks) and many readers on one spool at once.

Half the writers use `RecordWriter` directly, half hand rows to the engine's `SpoolWriter` thread block by block.

Every array any reader fetches — whole records, ranges, layer subsets, every format, batches, streams —
equals what its writer wrote (records are a pure function of the rid: `expected_rows`).
"""

from __future__ import annotations

import base64
import collections
import io
import random
import struct
import threading
from urllib.parse import quote

import httpx
import numpy as np
import orjson
from r3_harness import LAYERS, NUM_HIDDEN_LAYERS, TOPK, expected_rows, read_ledger

from service.client import RoutedExpertsClient

WRITERS = {"c0": 16, "c1": 40, "c2": 64, "c3": 100}  # prefix -> rows per record
ENGINE_WRITERS = {"c1", "c3"}  # these go through engine_ext.core.writer.SpoolWriter's thread, the others RecordWriter
PER_WRITER = 15
READERS = 6


def _want(rid: str, lo: int | None = None, hi: int | None = None, layers: list[int] | None = None) -> np.ndarray:
    arr = expected_rows(rid, WRITERS[rid.split("-")[0]])[lo:hi]
    if layers is not None:
        arr = arr[:, [LAYERS.index(x) for x in layers], :]
    return arr


def _frames(body: bytes) -> list[tuple[dict, bytes]]:
    out, pos = [], 0
    while pos < len(body):
        (n,) = struct.unpack_from("<I", body, pos)
        header = orjson.loads(body[pos + 4 : pos + 4 + n])
        pos += 4 + n
        size = int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize if header["status"] == 200 else 0
        out.append((header, body[pos : pos + size]))
        pos += size
    return out


def _reader(url: str, rids: list[str], seed: int, tally: collections.Counter, bad: list[str]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as http, RoutedExpertsClient(url, timeout=60) as client:
        for _ in range(40):
            rid, why = rng.choice(rids), ""
            rows = WRITERS[rid.split("-")[0]]
            path = f"/routed_experts/{quote(rid, safe='')}"
            kind = rng.choice(["raw", "range", "layers", "npy", "b64", "batch", "stream"])
            lo = rng.randrange(0, rows)
            hi = rng.randrange(lo + 1, rows + 1)
            sub = sorted(rng.sample(LAYERS, rng.randint(1, len(LAYERS))))
            if kind == "raw":
                r = http.get(path, params={"format": "raw", "wait": 30})
                ok = r.status_code == 200 and r.content == _want(rid).tobytes()
            elif kind == "range":
                r = http.get(path, params={"format": "raw", "wait": 30, "start": lo, "end": hi})
                ok = r.status_code == 200 and r.content == _want(rid, lo, hi).tobytes()
            elif kind == "layers":
                r = http.get(
                    path,
                    params={"format": "raw", "wait": 30, "start": lo, "end": hi, "layers": ",".join(map(str, sub))},
                )
                ok = r.status_code == 200 and r.content == _want(rid, lo, hi, sub).tobytes()
            elif kind == "npy":
                r = http.get(path, params={"wait": 30})
                ok = r.status_code == 200 and np.array_equal(np.load(io.BytesIO(r.content)), _want(rid))
            elif kind == "b64":
                r = http.get(path, params={"format": "sglang_b64", "wait": 30})
                full = np.zeros((WRITERS[rid.split("-")[0]], NUM_HIDDEN_LAYERS, TOPK), dtype=np.int32)
                full[:, list(LAYERS), :] = _want(rid)  # SGLang's layout: dense layers as zero rows
                want = base64.b64encode(full.tobytes())
                ok = r.status_code == 200 and r.content == want
            elif kind == "batch":
                some = rng.sample(rids, 5)
                r = http.post("/routed_experts/batch", json={"rids": some, "wait": 30, "layers": sub})
                frames = _frames(r.content) if r.status_code == 200 else []
                ok = [h["rid"] for h, _ in frames] == some and all(
                    h["status"] == 200 and p == _want(h["rid"], layers=sub).tobytes() for h, p in frames
                )
            else:
                try:
                    blocks = [b.array for b in client.stream(rid, start=lo, wait=30)]
                    ok = np.array_equal(np.concatenate(blocks), _want(rid, lo))
                except Exception as exc:  # counted as a mismatch with its reason, not a silently dead reader
                    ok, why = False, f": {exc!r}"
            tally[kind] += 1
            if not ok:
                bad.append(f"{kind} {rid} lo={lo} hi={hi} layers={sub}{why}")


def test_many_writers_many_readers_exact(make_sidecar, make_writer, spool_dir, tmp_path):
    side = make_sidecar(spool_dir)
    rids = [f"{p}-{i:06d}" for p in WRITERS for i in range(PER_WRITER)]
    writers = [
        make_writer(
            spool_dir,
            tmp_path / f"{p}.jsonl",
            [
                "--prefix",
                p,
                "--count",
                str(PER_WRITER),
                "--rows",
                str(rows),
                "--chunk",
                "7",
                "--pace",
                "0.002",
                *(["--engine-writer"] if p in ENGINE_WRITERS else []),
            ],
        )
        for p, rows in WRITERS.items()
    ]
    tally: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    readers = [threading.Thread(target=_reader, args=(side.url, rids, seed, tally, bad)) for seed in range(READERS)]
    for t in readers:
        t.start()
    for w in writers:
        w.wait(timeout=120)
    for t in readers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in readers)
    written = [e["rid"] for p in WRITERS for e in read_ledger(tmp_path / f"{p}.jsonl") if e.get("final")]
    assert sorted(written) == sorted(rids)
    print(
        f"concurrency: {len(WRITERS)} writer processes ({len(ENGINE_WRITERS)} via SpoolWriter), {READERS} readers, "
        f"fetches by kind {dict(tally)}, "
        f"mismatches {len(bad)}"
    )
    assert sum(tally.values()) == READERS * 40
    assert not bad, bad[:5]
