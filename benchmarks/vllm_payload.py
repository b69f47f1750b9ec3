"""What vLLM's inline routed experts cost the API server per response, and what the plugin's sidecar mode pays
instead: vLLM's own classes, real shapes, in the vLLM venv.

    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks.vllm_payload

Per response, on the API server's event loop (the one thread that builds every response):
- inline: `numpy2base64` of the joined array (vLLM's `routed_experts` field) and the JSON of a
  `CompletionResponse` carrying it (`model_dump_json`, what FastAPI sends);
- sidecar: the plugin's hand-off (`Spooler.finish`: reserve bytes, queue the array for the writer thread) and
  the JSON of the same response with `routed_experts=None` and a `routed_experts_url`.
The writer thread's file write is off the event loop and not counted here. Best of `--reps` timings.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import numpy as np
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.utils.serial_utils import numpy2base64

from benchmarks.vllm_server import BENCHMARKS, PAYLOAD_FRAGMENT, section, splice
from engine_ext.core.records import Finished, ModelShape
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.vllm.spooler import Spooler

SHAPES = {  # name: (layers, experts, topk)
    "Qwen3-30B-A3B": (48, 128, 8),
    "DeepSeek-V3": (61, 256, 8),
}


def best(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def response(choice: CompletionResponseChoice) -> CompletionResponse:
    usage = UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    return CompletionResponse(id="cmpl-b", created=0, model="m", choices=[choice], usage=usage)


def measure(spooler: Spooler, rows: np.ndarray, reps: int) -> tuple[float, float, int, int]:
    """(inline seconds, sidecar seconds, inline bytes, sidecar bytes) of one response carrying `rows`."""

    def inline() -> str:
        choice = CompletionResponseChoice(index=0, text="", routed_experts=numpy2base64(rows))
        return response(choice).model_dump_json()

    def sidecar() -> str:
        spooler.finish(Finished("cmpl-b-0", rows, start=0, prompt_len=len(rows) // 2, status="ok"))
        choice = CompletionResponseChoice(index=0, text="", routed_experts=None)
        choice.routed_experts_url = spooler.pointer("cmpl-b-0")
        return response(choice).model_dump_json()

    def timed_sidecar() -> float:
        took = best(sidecar, 1)
        spooler.writer.flush(30)  # the writer thread's work, off the event loop: outside the timing
        return took

    t_inline = best(inline, reps)
    t_sidecar = min(timed_sidecar() for _ in range(reps))
    return t_inline, t_sidecar, len(inline()), len(sidecar())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md as it is")
    args = ap.parse_args()
    spool = tempfile.mkdtemp(prefix="r3-vllm-payload-")
    lines = [
        "### What the inline payload costs the API server per response (vLLM's own classes)",
        "",
        "`PYTHONPATH=. .venv-vllm/bin/python -m benchmarks.vllm_payload` (`benchmarks/vllm_payload.py`): on the API",
        "server's event loop, inline is vLLM's `numpy2base64` of the joined array plus the `CompletionResponse`",
        "JSON; sidecar is the plugin's hand-off (`Spooler.finish`: reserve, queue for the writer thread) plus the",
        "same JSON with a pointer. The writer thread's write runs off the loop and is not counted; vLLM's joining of",
        f"the per-step chunks happens in both modes and is not counted either. Best of {args.reps}, this machine.",
        "",
        "| model (layers × top-k, uint8) | tokens | inline (ms) | sidecar (ms) | inline bytes | sidecar bytes |",
        "|---|---|---|---|---|---|",
    ]
    for name, (layers, experts, topk) in SHAPES.items():
        settings = EngineSettings(spool_dir=spool, mode=Mode.SIDECAR, sidecar_url="http://sidecar:8000")
        spooler = Spooler(settings, ModelShape(experts, topk, layers, tuple(range(layers))), engine="b", vllm="")
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = np.random.default_rng(0).integers(0, experts, size=(tokens, layers, topk)).astype(np.uint8)
            t_inline, t_sidecar, b_inline, b_sidecar = measure(spooler, rows, args.reps)
            lines.append(
                f"| {name} ({layers} × {topk}) | {tokens} | {t_inline * 1e3:.2f} | {t_sidecar * 1e3:.3f} | "
                f"{b_inline:,} | {b_sidecar:,} |"
            )
        spooler.close()
    print("\n".join(lines))
    if not args.no_write:
        PAYLOAD_FRAGMENT.write_text("\n".join(lines) + "\n")
        splice(BENCHMARKS, section())


if __name__ == "__main__":
    main()
