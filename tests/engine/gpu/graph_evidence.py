"""What SGLang's own log says about its graphs: the sizes it captured and whether a batch ran in one.

A record equal to the inline payload proves nothing about CUDA graphs unless the forward that produced it ran
in one. SGLang logs the captured sizes at start and, per prefill batch and every `decode_log_interval` decode
steps, `cuda graph: True|False` (`cpu graph` on the CPU). Spellings per version (read from the wheels):

- 0.5.12: `Capture cuda graph bs [1, 2, 4, 8]`, `Capture cuda graph num tokens [4, 8, …]` (piecewise)
- 0.5.16: `Capture target decode CUDA graph begin. … bs=[1, 2, 4, 8], …`,
  `Capture target prefill CUDA graph begin. … num_tokens=[4, 8, …], …`
- both: `Prefill batch, … #new-token: N, … cuda graph: True, …`, `Decode batch, #running-req: N, … cuda graph: True`
"""

from __future__ import annotations

import re
from typing import Any

DECODE_SIZES = re.compile(r"Capture (?:cuda graph bs |\w+ decode cuda graph begin\..*?bs=)\[([\d, ]*)\]", re.I)
PREFILL_SIZES = re.compile(
    r"Capture (?:cuda graph num tokens |\w+ prefill cuda graph begin\..*?num_tokens=)\[([\d, ]*)\]", re.I
)
DECODE_STEP = re.compile(r"Decode batch.*?#running-req: (\d+),.*?(?:cuda|cpu) graph: (True|False)")
PREFILL_STEP = re.compile(r"Prefill batch.*?#new-token: (\d+),.*?(?:cuda|cpu) graph: (True|False)")


def _sizes(pattern: re.Pattern[str], log: str) -> list[int] | None:
    found = pattern.search(log)
    return None if found is None else [int(s) for s in found.group(1).replace(" ", "").split(",") if s]


def evidence(log: str, long_prompt: int) -> dict[str, Any]:
    """The captured sizes, and the graph flags of the decode lines at 3 running requests and of the long prefill."""
    return {
        "long_prompt": long_prompt,
        "decode_sizes": _sizes(DECODE_SIZES, log),
        "prefill_sizes": _sizes(PREFILL_SIZES, log),
        "decode_at_3": [m.group(2) == "True" for m in DECODE_STEP.finditer(log) if m.group(1) == "3"],
        "long_prefill": [m.group(2) == "True" for m in PREFILL_STEP.finditer(log) if int(m.group(1)) == long_prompt],
    }


def judge(checks: Any, name: str, seen: dict[str, Any], *, gpu: bool) -> None:
    """On the GPU: 3 padded into a captured 4, those steps and the long prefill in graphs. On the CPU: the lines
    are there and say no graph (what the rehearsal can prove of this parsing)."""
    decode, prefill = seen["decode_at_3"], seen["long_prefill"]
    if not gpu:
        checks.expect(f"{name}: decode lines at bs 3, no graph (CPU)", decode and not any(decode), f"{decode}")
        checks.expect(f"{name}: the long prefill's line, no graph (CPU)", prefill and not any(prefill), f"{prefill}")
        return
    sizes, tokens = seen["decode_sizes"] or [], seen["prefill_sizes"] or []
    checks.expect(f"{name}: decode graphs captured for 4, not 3", 4 in sizes and 3 not in sizes, f"{sizes}")
    checks.expect(f"{name}: the batch of 3 decoded in a graph", bool(decode) and all(decode), f"{decode}")
    covered = bool(tokens) and max(tokens) >= seen["long_prompt"]
    checks.expect(f"{name}: piecewise graphs captured", covered, f"{tokens[:4]}…{tokens[-2:]}")
    checks.expect(
        f"{name}: the long prompt prefilled in a piecewise graph", bool(prefill) and all(prefill), f"{prefill}"
    )
