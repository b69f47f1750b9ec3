"""Real SGLang servers on a GPU at SGLang's defaults: upstream vs mirror vs sidecar, then a paired tok/s A/B.

    tests/engine/gpu/run_servers.sh .gpu-0.5.12          # on the GPU machine, one device call (README.md)
    PYTHONPATH=$PWD .venv/bin/python tests/engine/gpu/servers.py --cpu-rehearsal \\
        --python .venv-sglang-0.5.12/bin/python --out /tmp/r3-rehearsal    # the same sequence on CPU servers

What one run proves for the SGLang that `--python` imports (0.5.12 or 0.5.16 on the lent image):

1. Three servers of the tiny seeded Qwen3-MoE (`tests/e2e/tiny_weights.py`, head_dim 64: SGLang's rope kernel,
   so bfloat16 runs) — upstream (plugin off), mirror, sidecar mode — launched at SGLang's GPU defaults (CUDA
   graphs, piecewise CUDA graphs, overlap scheduling; `sglang_server.GPU_ARGS`) answer the same requests, one
   at a time: a short one, a batch of 3 that decodes together (a padded bs-4 decode graph), a long prompt (one
   piecewise-graph prefill) and one with `routed_experts_start_len`; mirror also an abort mid-decode. Every
   record, in the spool and as the pointer fetches it from the sidecar, is SGLang's inline payload byte for
   byte (mirror: the same response's; sidecar: upstream's for the same request), and the plugin changes no
   token. The logs must show the graphs ran: captured decode sizes holding 4 and not 3, decode steps of the
   batch of 3 in a graph, the long prompt's prefill in a piecewise graph.
2. A paired three-way A/B (`benchmarks/paired.py`, `THREE_WAY`): routed experts off, SGLang's inline routed
   experts (plugin off), r3-sidecar in sidecar mode; output tok/s at Qwen3-30B-A3B's layer shape with dummy
   weights and fewer layers; 95% intervals; `gpu_servers.md`, a BENCHMARKS.md fragment naming the card and
   versions.

The A/B's three servers start together with the comparison's three (one GPU: each server's KV pool is capped,
GPU_ARGS) and are measured once those are stopped; its rounds fill what `--budget-s` leaves. Under `--out` (at
most 8 files come back from the device): `results.json` (rewritten after each phase), `gpu_servers.md`, `logs.tar.gz`.
Any failed check: the list, exit 1.

`--cpu-rehearsal` runs the same sequence on this machine's CPU servers: only the launch (sglang_server's CPU
flags), the A/B's shape (real_server's CPU bench, two rounds) and the graph evidence differ (the log lines
must be found, and say no graph ran).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import re
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e"), str(Path(__file__).resolve().parent)]

import sglang_server  # noqa: E402
from graph_evidence import evidence, judge  # noqa: E402
from server_checks import Checks, compare  # noqa: E402
from server_report import environment, fragment  # noqa: E402
from sglang_server import Config, Stack, sglang_version_string, start  # noqa: E402

from benchmarks import paired  # noqa: E402
from benchmarks.real_server.workloads import ROUTED_FLAG, Bench  # noqa: E402

# The tiny model on the GPU: head_dim 64 (16 takes SGLang's fallback rope, which refuses bfloat16's fused KV write)
TINY = {"head_dim": 64, "max_position_embeddings": 4096}
# Qwen3-30B-A3B's config.json, less its depth (`--ab-layers` of its 48)
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class RecipeBench(Bench):
    """real_server's Bench as this recipe launches it: that version's python; on the GPU, Qwen3-30B-A3B's layers."""

    python: str = sys.executable
    gpu: bool = False

    def model(self) -> dict[str, Any]:
        return QWEN3_30B_A3B | {"num_hidden_layers": self.layers} if self.gpu else super().model()

    def server_config(self, mode: str) -> Config:
        config = replace(super().server_config(mode), name=f"ab-{mode}", python=self.python)
        if not self.gpu:
            return config
        args = {
            "load-format": "dummy",
            "context-length": 4096,
            "max-running-requests": 2 * self.streams,
            "cuda-graph-max-bs": 2 * self.streams,  # the capture range only; graphs stay on
            "max-total-tokens": 4 * self.streams * (self.prompt + self.output),
            "sleep-on-idle": True,
        }
        args |= {k: v for k, v in config.args.items() if k == ROUTED_FLAG}  # `off`: the capture stays off
        return replace(config, gpu=True, args=args, env={k: v for k, v in config.env.items() if k.startswith("R3_")})


@dataclass(frozen=True)
class Plan:
    python: str
    gpu: bool
    long_prompt: int  # tokens: one prefill, in a piecewise graph on the GPU
    decode_tokens: int  # the batch of 3: enough steps for SGLang's decode log line (every 40 steps)
    abort_tokens: int
    ab: RecipeBench
    ab_rounds: int
    budget_s: float

    def tiny_configs(self) -> dict[str, Config]:
        # On the CPU one chunk takes the long prompt, as on the GPU (SGLang's default chunk there is larger)
        args = {"cuda-graph-max-bs": 8} if self.gpu else {"chunked-prefill-size": 4096, "max-total-tokens": 16384}
        base = Config("tiny-upstream", plugin=False, sidecar=False, args=args, model=TINY, python=self.python)
        base = replace(base, gpu=self.gpu)
        return {
            "upstream": base,
            "mirror": replace(base, name="tiny-mirror", plugin=True, sidecar=True, env={"R3_MODE": "mirror"}),
            "sidecar": replace(base, name="tiny-sidecar", plugin=True, sidecar=True, env={"R3_MODE": "sidecar"}),
        }


def make_plan(args: argparse.Namespace) -> Plan:
    if args.cpu_rehearsal:
        bench = RecipeBench(layers=4, experts=16, topk=4, streams=4, prompt=32, output=16, python=args.python)
        return Plan(args.python, False, 1024, 100, 1500, bench, 2, args.budget_s)
    bench = RecipeBench(
        layers=args.ab_layers, experts=128, topk=8, streams=32, prompt=512, output=256, python=args.python, gpu=True
    )
    return Plan(args.python, True, 3000, 100, 3000, bench, 1000, args.budget_s)


def _log(msg: str) -> None:
    print(f"[gpu-servers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_all(configs: dict[str, Config], workdir: Path, *, parallel: bool) -> dict[str, Stack]:
    """Start every configuration (at once, or one after another on two CPU cores); on any failure stop the others
    and raise with every failure's log tail."""
    stacks, errors = {}, []
    with concurrent.futures.ThreadPoolExecutor(len(configs) if parallel else 1) as pool:
        futures = {name: pool.submit(start, config, workdir / config.name) for name, config in configs.items()}
        for name, future in futures.items():
            try:
                stacks[name] = future.result()
            except Exception as exc:  # reported once the others are stopped
                errors.append(f"{name}: {exc}")
    if errors:
        stop_all(stacks)
        raise RuntimeError("\n".join(errors))
    return stacks


def stop_all(stacks: dict[str, Stack]) -> None:
    for stack in stacks.values():
        stack.stop()


class Run:
    """One run's state: the plan, the checks, the results written under `out` after each phase."""

    def __init__(self, plan: Plan, out: Path, workdir: Path) -> None:
        self.plan, self.out, self.workdir = plan, out, workdir
        self.checks = Checks()
        self.t0 = time.perf_counter()
        self.results: dict[str, Any] = {"plan": _plan_dict(plan), "phases": {}}

    def phase(self, name: str) -> None:
        self.results["phases"][name] = round(time.perf_counter() - self.t0, 1)
        self.results["checks"] = self.checks.rows
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        _log(f"{name} at {self.results['phases'][name]:.0f} s; {len(self.checks.failed())} checks failed so far")

    def left_s(self) -> float:
        return self.plan.budget_s - (time.perf_counter() - self.t0)


def _plan_dict(plan: Plan) -> dict[str, Any]:
    return {k: v for k, v in plan.__dict__.items() if k != "ab"} | {"ab": plan.ab.__dict__}


def compare_phase(run: Run) -> None:
    """The tiny model's three servers: same requests, records against inline payloads, graph evidence."""
    plan = run.plan
    stacks = start_all(plan.tiny_configs(), run.workdir, parallel=plan.gpu)
    run.phase("tiny servers up")
    try:
        run.results["compare"] = compare(run.checks, stacks, plan)
        for name, stack in stacks.items():
            seen = evidence(stack.server.log_text(), plan.long_prompt)
            run.results.setdefault("graphs", {})[name] = seen
            judge(run.checks, name, seen, gpu=plan.gpu)
    finally:
        stop_all(stacks)
    run.phase("compared")


# SGLang's start-up line of its settings, a dict (`'enable_return_routed_experts': True`) or ServerArgs(...=True)
ROUTED_SETTING = re.compile(r"enable_return_routed_experts'?(?:=|: )(True|False)")

# The least budget left, once the A/B's servers are up, that the A/B starts with on the GPU: two ~6 s rounds
# after a warm-up, the 45 s margin for stopping the servers and writing the logs, and some slack
AB_MIN_S = 75.0


def ab_phase(run: Run, starting: concurrent.futures.Future, started: float) -> None:
    """The A/B on the two servers started beside the three: rounds until the budget's end, less a margin; on the
    GPU none when the comparison left too little (a cut run would lose its logs, not gain a figure)."""
    stacks = starting.result()
    if run.plan.gpu and run.left_s() < AB_MIN_S:  # no room for two rounds: keep the time to write what was seen
        stop_all(stacks)
        run.results["ab"] = {"skipped": f"{run.left_s():.0f} s of the budget left once its servers were up"}
        run.phase("A/B skipped")
        return
    for mode, stack in stacks.items():  # the `off` arm really ran without SGLang's capture, the others with it
        flags = ROUTED_SETTING.findall(stack.server.log_text())
        want = "False" if mode == "off" else "True"
        run.checks.expect(f"A/B {mode}: enable_return_routed_experts={want}", flags[:1] == [want], f"{flags[:1]}")
    try:
        # On the GPU the budget decides how many rounds; the rehearsal runs its two whatever the CPU's load
        minutes = max(run.left_s() - 45.0, 30.0) / 60 if run.plan.gpu else 60.0
        results = paired.measure(
            stacks,
            run.plan.ab,
            rounds=run.plan.ab_rounds,
            minutes=minutes,
            pin=False,
            started=started,
            modes=paired.THREE_WAY,
        )
    finally:
        stop_all(stacks)
    run.results["ab"] = results
    n = results["summary"]["tok_s"]["n"]
    run.checks.expect("A/B: at least two paired rounds", n >= 2, f"{n} rounds")
    run.phase("A/B measured")


def execute(run: Run) -> None:
    """The comparison, then the A/B. On the GPU the A/B's servers start during the comparison (their start, graph
    capture included, is most of their cost); the CPU rehearsal starts them after it (two cores)."""
    run.results["environment"] = environment(run.plan.python)
    run.phase("environment")
    configs = {mode: run.plan.ab.server_config(mode) for mode in paired.THREE_WAY}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        starting = pool.submit(start_all, configs, run.workdir / "ab", parallel=True) if run.plan.gpu else None
        try:
            compare_phase(run)
        except BaseException:
            if starting is not None:
                with contextlib.suppress(Exception):
                    stop_all(starting.result())
            raise
        if starting is None:
            started = time.perf_counter()
            starting = pool.submit(start_all, configs, run.workdir / "ab", parallel=False)
        ab_phase(run, starting, started)


def keep_logs(workdir: Path, out: Path) -> None:
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(workdir.rglob("*.log")):
            tar.add(log, arcname=str(log.relative_to(workdir)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python", default=sys.executable, help="the python whose SGLang the servers run")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="CPU servers: everything but the GPU")
    ap.add_argument("--budget-s", type=float, default=330.0, help="the whole run; the A/B's rounds fill the rest")
    ap.add_argument("--ab-layers", type=int, default=16, help="of Qwen3-30B-A3B's 48 layers")
    ap.add_argument("--start-timeout-s", type=float, help="per server start (a loaded CPU machine needs more)")
    args = ap.parse_args()
    if args.start_timeout_s:
        sglang_server.START_TIMEOUT_S = args.start_timeout_s
    plan = make_plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="r3-gpu-servers-"))
    run = Run(plan, args.out, workdir)
    run.results["version"] = sglang_version_string(plan.python)  # a post release as the engine file names it
    try:
        execute(run)
    except BaseException as exc:  # the run stops; what it saw is written below
        where = traceback.format_exception(exc)[-2].strip() if exc.__traceback__ else ""
        run.checks.expect("the run completed", False, f"{where}\n{type(exc).__name__}: {str(exc)[:6000]}")
    finally:
        run.phase("end")
        (args.out / "gpu_servers.md").write_text(fragment(run.results))
        keep_logs(workdir, args.out)
    failed = run.checks.failed()
    for row in failed:
        print(f"FAILED {row['check']}: {row['detail']}", file=sys.stderr)
    verdict = f"{len(failed)} of {len(run.checks.rows)} checks failed" if failed else "every check passed"
    print(f"{'FAIL' if failed else 'PASS'}: {verdict} ({run.results['version']}, {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
