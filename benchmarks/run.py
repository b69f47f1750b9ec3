"""`make bench`: every measurement in one run, then BENCHMARKS.md and the plots.

    .venv/bin/python -m benchmarks.run            # full run (about 4 minutes on 2 shared cores, 15 at load ~10)
    .venv/bin/python -m benchmarks.run --quick    # seconds: small shapes, for a harness check
    .venv/bin/python -m benchmarks.run --only delivery,limits --no-report

Results go to `benchmarks/out/results.json` (raw numbers); the report is regenerated from them by
`python -m benchmarks.report`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from benchmarks.environment import environment
from benchmarks.shapes import SHAPES, inline_layout, routing

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SECTIONS = ("delivery", "concurrency", "limits", "breakdown", "engine", "memory")


@dataclass(frozen=True)
class Config:
    """What one run measures; `quick()` is the same harness on shapes small enough for a test."""

    models: tuple[str, ...] = tuple(SHAPES)
    tokens: tuple[int, ...] = (1024, 8192, 32768)
    reps: dict[int, int] = field(default_factory=lambda: {1024: 30, 8192: 40, 32768: 15})
    batch_model: str = "Qwen3-30B-A3B"
    batch_records: int = 256
    batch_tokens: int = 8192
    batch_bases: int = 8
    concurrency: tuple[int, ...] = (1, 8, 64)
    get_many_chunk: int = 4
    rounds: int = 3
    settle_s: float = 2.0
    live_batch: int = 64
    live_steps: int = 100
    memory_gib: tuple[float, ...] = (1.0, 10.0)
    seed: int = 20261122
    sections: tuple[str, ...] = SECTIONS

    @classmethod
    def quick(cls, **overrides) -> Config:
        small = {
            "tokens": (128,),
            "reps": {128: 2},
            "batch_records": 8,
            "batch_tokens": 128,
            "batch_bases": 2,
            "concurrency": (1, 4),
            "get_many_chunk": 2,
            "rounds": 1,
            "settle_s": 0.0,
            "live_batch": 4,
            "live_steps": 3,
            "memory_gib": (1 / 256,),
        }
        return cls(**{**small, **overrides})

    def reps_for(self, tokens: int) -> int:
        return self.reps.get(tokens, 3)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(config: Config, workdir: Path) -> dict:
    """Measure the configured sections; `workdir` holds payloads and spools and is left for the caller."""
    from benchmarks import breakdown, concurrency, delivery, engine_cost, limits, memory
    from benchmarks.servers import serve
    from service.spool import Spool

    results: dict = {"config": asdict(config), "environment": environment()}
    longest = max(config.tokens)
    compact = {m: routing(SHAPES[m], longest - 1, config.seed + i) for i, m in enumerate(config.models)}
    _log(f"routing generated for {', '.join(config.models)} up to {longest} tokens")

    spool_root = workdir / "spool"
    spool = Spool(spool_root)
    needs_servers = {"delivery", "concurrency", "limits", "breakdown"} & set(config.sections)
    batch_shape = SHAPES[config.batch_model]

    if needs_servers:
        payload_dir = workdir / "inline"
        cases = {}
        for m in config.models:
            for t in config.tokens:
                cases[delivery.case_name(SHAPES[m], t)] = (inline_layout(SHAPES[m], compact[m][: t - 1]), t // 2)
        if "delivery" in config.sections:
            delivery.write_inline_payloads(payload_dir, cases)
        with (
            serve("inline", payload_dir if payload_dir.exists() else workdir) as inline,
            serve("sidecar", spool_root) as sidecar,
        ):
            results["servers"] = {"inline_pid": inline.pid, "sidecar_pid": sidecar.pid}
            if "delivery" in config.sections:
                rows = []
                for m in config.models:
                    for t in config.tokens:
                        host = cases[delivery.case_name(SHAPES[m], t)][0]
                        r = delivery.measure_case(
                            inline.url, sidecar.url, spool, SHAPES[m], t, compact[m][: t - 1], host, config.reps_for(t)
                        )
                        _log(f"delivery {m} {t}: {r['speedup']:.1f}x, bytes {r['bytes_ratio']:.3f}")
                        rows.append(r)
                results["delivery"] = rows
            del cases

            if {"concurrency", "limits", "breakdown"} & set(config.sections):
                bases = [
                    routing(batch_shape, config.batch_tokens - 1, config.seed + 100 + i)
                    for i in range(config.batch_bases)
                ]
                rids = concurrency.write_batch(spool, batch_shape, bases, config.batch_records, "batch")
                record_bytes = bases[0].nbytes
                batch_bytes = record_bytes * len(rids)
                _log(f"batch of {len(rids)} records, {batch_bytes / 1e6:.0f} MB written")

            if "concurrency" in config.sections:
                time.sleep(config.settle_s)  # let the kernel finish with the batch just written
                combos = [(mode, c) for mode in concurrency.MODES for c in config.concurrency]
                cold = {
                    (mode, c): concurrency.drain(
                        sidecar.url, rids, c, mode, config.get_many_chunk, bases[0].shape, warm=False
                    )
                    for mode, c in combos
                }
                warm: dict[tuple[str, int], list[dict]] = {combo: [] for combo in combos}
                for _ in range(config.rounds):  # interleaved, so drifts in load hit every client alike
                    for mode, c in combos:
                        warm[mode, c].append(
                            concurrency.drain(sidecar.url, rids, c, mode, config.get_many_chunk, bases[0].shape)
                        )
                rows = []
                for combo in combos:
                    rounds = sorted(warm[combo], key=lambda r: r["gbps"])
                    r = rounds[len(rounds) // 2] | {"cold": cold[combo], "rounds": warm[combo]}
                    _log(f"concurrency {combo[0]} x{combo[1]}: {r['gbps']:.2f} GB/s, p99/p50 {r['p99_over_p50']:.2f}")
                    rows.append(r)
                results["concurrency"] = rows

            if "limits" in config.sections:
                reps = max(3, config.rounds * 2)
                results["limits"] = {
                    "record_bytes": record_bytes,
                    "batch_bytes": batch_bytes,
                    "memcpy_record": limits.memcpy_gbps(record_bytes, 50),
                    "memcpy_batch": limits.memcpy_gbps(batch_bytes, reps),
                    "loopback": limits.loopback_gbps(record_bytes, len(rids), reps),
                    "loopback_round_trips": limits.loopback_round_trips_gbps(record_bytes, len(rids), reps),
                }
                _log(
                    f"limits: loopback {results['limits']['loopback']['gbps']:.2f} GB/s streaming, "
                    f"{results['limits']['loopback_round_trips']['gbps']:.2f} GB/s one record per round trip"
                )

            if "breakdown" in config.sections:
                results["breakdown"] = {
                    "client_stacks": breakdown.client_stacks(sidecar.url, rids[0], record_bytes, 20),
                }
                _log("breakdown: client stacks measured")

    if {"breakdown", "engine"} & set(config.sections):
        import torch

        # One intra-op thread: on a shared 2-core machine torch's OpenMP pool turns the gather's wall time into
        # scheduling noise. Both paths gather with torch, so the comparison is unaffected.
        torch.set_num_threads(1)

    if "breakdown" in config.sections:
        results.setdefault("breakdown", {})["compaction"] = [
            row
            for m in config.models
            for row in breakdown.compaction(
                SHAPES[m], longest + 1024, config.tokens, config.reps_for(min(config.tokens))
            )
        ]
        results["breakdown"]["live_compaction"] = [
            breakdown.live_compaction(SHAPES[m], config.live_batch, 50) for m in config.models
        ]

    if "engine" in config.sections:
        rows = []
        for m in config.models:
            collection = engine_cost.UpstreamCollection(SHAPES[m], compact[m])
            for t in config.tokens:
                r = engine_cost.finish_cost(SHAPES[m], collection, t, config.reps_for(t))
                _log(
                    f"engine {m} {t}: upstream {r['upstream_total']['p50'] * 1e3:.2f} ms, "
                    f"ours {r['ours_total']['p50'] * 1e3:.2f} ms"
                )
                rows.append(r)
            del collection
        live = [engine_cost.live_step_cost(SHAPES[m], config.live_batch, config.live_steps) for m in config.models]
        results["engine"] = {"finish": rows, "live": live}

    if "memory" in config.sections:
        shutil.rmtree(spool_root, ignore_errors=True)
        bases = [
            routing(batch_shape, config.batch_tokens - 1, config.seed + 200 + i) for i in range(config.batch_bases)
        ]
        rows = []
        for gib in config.memory_gib:
            wanted = int(gib * memory.GIB)
            size = memory.fitting_size(wanted, Path("/dev/shm"))
            if size < wanted:
                _log(f"memory: {gib} GiB does not fit now; measuring {size / memory.GIB:.1f} GiB")
            r = memory.measure_size(workdir / "mem-spool", batch_shape, bases, size, 8)
            r |= {"wanted_bytes": wanted, "fits": size >= wanted}
            _log(f"memory {r['spool_bytes'] / 1e9:.2f} GB: anon overhead {r['anon_overhead_ratio']:.4f}")
            rows.append(r)
        results["memory"] = rows

    results["environment_after"] = {
        "loadavg": list(os.getloadavg()),
        "date_utc": time.strftime("%H:%M:%S", time.gmtime()),
    }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes; seconds, not minutes")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=OUT / "results.json")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite BENCHMARKS.md and the plots")
    args = ap.parse_args()
    sections = tuple(s for s in args.only.split(",") if s)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    config = Config.quick(sections=sections) if args.quick else Config(sections=sections)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="r3-bench-", dir="/dev/shm") as tmp:
        results = run(config, Path(tmp))
    results["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    )
    _log(f"results in {args.out} after {results['wall_s']:.0f} s")
    if not args.no_report:
        from benchmarks.report import write_report

        write_report(results, ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "plots")
        _log("BENCHMARKS.md and benchmarks/plots/ written")


if __name__ == "__main__":
    main()
