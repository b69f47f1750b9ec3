"""A trainer process for the reliability soak: follows one writer's records in order, checks each, acknowledges it.

`--mode fetch`: `get(rid, wait=)` the whole record and a range with a layer subset, compare with
`expected_rows`, then DELETE. `--mode stream`: stream the record block by block as it is written, compare, DELETE.
The writer's ledger says when it has stopped (`{"event": "done", "count": n}`); one JSON line per record goes to
`--out` (`{"rid", "kind", "bytes", "blocks"}` or `{"rid", "error"}`), so the test can count and check everything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
from r3_harness import LAYERS, expected_rows

from service.client import R3Error, RoutedExpertsClient
from service.client.errors import NotReady, RecordNotFound

WAIT_S = 5


def writer_total(ledger: Path) -> int | None:
    """Records the writer finished, once it has said it is done (its ledger's last line); None while it runs."""
    with open(ledger, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 4096))
        tail = f.read().splitlines()
    try:
        last = json.loads(tail[-1]) if tail else {}
    except ValueError:
        return None
    return int(last["count"]) if last.get("event") == "done" else None


def check_fetch(client: RoutedExpertsClient, rid: str, rows: int) -> dict:
    want = expected_rows(rid, rows)
    got = client.get(rid, wait=WAIT_S)
    if not np.array_equal(got.array, want):
        return {"rid": rid, "error": "wrong rows"}
    lo, hi = rows // 4, rows // 2
    part = client.get(rid, start=lo, end=hi, layers=[LAYERS[1], LAYERS[4]])
    if not np.array_equal(part.array, want[lo:hi][:, [1, 4], :]):
        return {"rid": rid, "error": "wrong range/layers"}
    return {"rid": rid, "kind": "fetch", "bytes": int(want.nbytes + part.array.nbytes)}


def check_stream(client: RoutedExpertsClient, rid: str, rows: int) -> dict:
    blocks = [b.array for b in client.stream(rid, wait=WAIT_S)]
    if not blocks or not np.array_equal(np.concatenate(blocks), expected_rows(rid, rows)):
        return {"rid": rid, "error": f"wrong rows ({len(blocks)} blocks)"}
    return {"rid": rid, "kind": "stream", "bytes": int(sum(b.nbytes for b in blocks)), "blocks": len(blocks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--mode", choices=["fetch", "stream"], required=True)
    ap.add_argument("--ledger", required=True, type=Path)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    check = check_fetch if args.mode == "fetch" else check_stream
    with open(args.out, "a", buffering=1) as out, RoutedExpertsClient(args.url, timeout=30, retries=5) as client:
        i = 0
        while True:
            rid = f"{args.prefix}-{i:06d}"
            try:
                result = check(client, rid, args.rows)
            except R3Error as exc:
                if isinstance(exc, RecordNotFound | NotReady):
                    total = writer_total(args.ledger)
                    if total is None:
                        continue  # not written yet: the writer is behind (backpressure); ask again
                    if i >= total:
                        return 0  # the writer stopped before this rid
                result = {"rid": rid, "error": repr(exc)}
            except httpx.HTTPError as exc:
                result = {"rid": rid, "error": repr(exc)}
            if "error" not in result:
                client.ack(rid)
            out.write(json.dumps(result) + "\n")
            i += 1


if __name__ == "__main__":
    raise SystemExit(main())
