"""Per-rank fetch vs whole records, and what a ref costs in Ray's object store vs the rows it stands for.

One record per case (a rollout of N tokens: N−1 rows) in a spool served by the sidecar in its own process.
Each training rank fetches its pipeline stage's layers and context-parallel chunks (`service.client.ranks.fetch_rank`,
server-side slicing); the whole record is what a rank fetches without it. Bytes are the sidecar's own count of
body bytes served (`r3_served_bytes_total`, read before and after); time is the median of repeated fetches on
a kept-alive connection. Ref sizes are `pickle.dumps` of the `RoutedExpertsRef` a trainer ships between actors
(rid and pointer as the plugin writes them), against the same rows as the spool's dtype and as SGLang's int32
all-layer rows (what is shipped when rows go through the object store).

    .venv/bin/python -m benchmarks.ranks            # writes benchmarks/ranks.md (kept in BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.servers import serve
from benchmarks.shapes import SHAPES, routing
from benchmarks.stats import summary
from engine_ext.core.records import routed_experts_url
from service.client.ranks import Place, fetch_rank
from service.client.refs import RoutedExpertsRef, SidecarPool
from service.spool import Spool

OUT = Path(__file__).resolve().parent / "ranks.md"
PLACES = {  # name → (pp, cp): each row is rank 0's (first stage: dense layers of DeepSeek-V3 included; CP rank 0)
    "whole record": (1, 1),
    "pp=4": (4, 1),
    "cp=4 (balanced)": (1, 4),
    "pp=4 × cp=2": (4, 2),
    "pp=8 × cp=4": (8, 4),
}


def first_stage(shape, pp: int) -> int | None:
    """A layer count that does not split evenly: the first stage takes the remainder (61 = 13 + 3·16)."""
    n = shape.num_hidden_layers
    return None if n % pp == 0 else n - (pp - 1) * -(-n // pp)


def served_bytes(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("r3_served_bytes_total "):
            return float(line.split()[1])
    raise RuntimeError("no r3_served_bytes_total")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        spool = Spool(Path(tmp))
        cases = []
        for shape_name in ("Qwen3-30B-A3B", "DeepSeek-V3"):
            shape = SHAPES[shape_name]
            for tokens in (8192, 32768):
                rid = str(uuid.UUID(int=tokens * 1000 + shape.num_hidden_layers))
                rows = routing(shape, tokens - 1, seed=tokens)
                writer = spool.writer(
                    rid,
                    num_experts=shape.num_experts,
                    topk=shape.topk,
                    layers=shape.moe_layers,
                    prompt_len=tokens // 4,
                    dtype=shape.dtype,
                    num_hidden_layers=shape.num_hidden_layers,
                )
                writer.append(rows)
                writer.finalize()
                cases.append((shape, tokens, rid, rows))
        with serve("sidecar", Path(tmp)) as server, SidecarPool(local_reads=False) as pool:
            header = "| model | tokens | rank's place | bytes per rank | of whole | ms per rank (p50) | of whole |"
            lines += [header, "|---|---|---|---|---|---|---|"]
            for shape, tokens, rid, _ in cases:
                ref = RoutedExpertsRef(rid=rid, url=routed_experts_url(server.url, rid))
                places = {
                    name: Place(pp_size=pp, pp_rank=0, cp_size=cp, cp_rank=0, first_stage=first_stage(shape, pp))
                    for name, (pp, cp) in PLACES.items()
                }
                nbytes, times = {}, {name: [] for name in places}
                for name, place in places.items():  # one fetch each: warms the path and counts its bytes
                    before = served_bytes(server.url)
                    fetch_rank([ref], [tokens], place, shape.num_hidden_layers, pool=pool)
                    nbytes[name] = served_bytes(server.url) - before
                for _ in range(args.reps):  # the places interleaved, so a busy moment hits them alike
                    for name, place in places.items():
                        t0 = time.perf_counter()
                        fetch_rank([ref], [tokens], place, shape.num_hidden_layers, pool=pool)
                        times[name].append((time.perf_counter() - t0) * 1e3)
                ms = {name: summary(t)["p50"] for name, t in times.items()}
                whole_bytes, whole_ms = nbytes["whole record"], ms["whole record"]
                for name in places:
                    lines.append(
                        f"| {shape.name} | {tokens} | {name} | {nbytes[name] / 1e6:.3f} MB "
                        f"| {nbytes[name] / whole_bytes:.3f} | {ms[name]:.2f} | {ms[name] / whole_ms:.2f} |"
                    )
            lines += ["", "| model | tokens | ref pickled | rows, spool dtype | rows, int32 all layers | ratio |"]
            lines += ["|---|---|---|---|---|---|"]
            for shape, tokens, rid, rows in cases:
                url = routed_experts_url("http://10.128.4.17:8000", rid)
                ref = RoutedExpertsRef(rid=rid, url=url, start_len=0, prompt_len=tokens // 4, rows=tokens - 1)
                size = len(pickle.dumps(ref, protocol=pickle.HIGHEST_PROTOCOL))
                int32 = (tokens - 1) * shape.num_hidden_layers * shape.topk * 4
                lines.append(
                    f"| {shape.name} | {tokens} | {size} B | {rows.nbytes / 1e6:.2f} MB | {int32 / 1e6:.2f} MB "
                    f"| 1 : {int32 / size:,.0f} |"
                )
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.insert(
        0, f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.reps} reps, load average {load}.\n"
    )
    text = "\n".join(lines) + "\n"
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
